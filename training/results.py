"""Results writer shared by the reproductions and the speed benchmarks: one table as JSON + Markdown, with provenance.

Every committed result says how it was obtained: the exact command, the configuration, the seeds and
the hardware it ran on (README standard). ``write_results`` records all four next to the numbers.
"""

import json
import os
import platform
import shlex
import sys
import time


def hardware_summary() -> dict:
    """What the numbers were measured on: CPU/GPU, thread count, library versions."""
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def current_command() -> str:
    """The command line that is running, as a user would type it."""
    argv = list(sys.argv)
    module = sys.modules["__main__"].__spec__
    if module is not None and module.name:
        argv = ["python", "-m", module.name.removesuffix(".__main__")] + argv[1:]
    else:
        argv = ["python"] + argv
    return " ".join(shlex.quote(arg) for arg in argv)



def _format(value, digits):
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "" if value is None else str(value)


def markdown_table(rows: list[dict], columns: list[str] | None = None, digits: int = 4) -> str:
    """Render ``rows`` (dicts with the same keys) as a Markdown table."""
    if not rows:
        return "_(no rows)_\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(col), digits) for col in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(
    out_dir: str,
    name: str,
    rows: list[dict],
    *,
    title: str,
    config: dict | None = None,
    seeds: list[int] | None = None,
    notes: str = "",
    columns: list[str] | None = None,
    command: str | None = None,
    extra: dict | None = None,
) -> tuple[str, str]:
    """Write ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md``; return both paths.

    Files are written to a temporary name first and renamed, so an interrupted run never leaves a
    half-written result behind.
    """
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "title": title,
        "command": command or current_command(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": hardware_summary(),
        "seeds": seeds,
        "config": config or {},
        "rows": rows,
        "notes": notes,
    }
    if extra:
        record.update(extra)
    md = [f"# {title}", "", markdown_table(rows, columns)]
    if notes:
        md += [notes.strip(), ""]
    md += [
        "## Provenance",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}",
        f"- seeds: {seeds if seeds is not None else 'n/a'}",
        f"- hardware: {json.dumps(record['hardware'])}",
        f"- config: `{json.dumps(record['config'], sort_keys=True, default=str)}`",
        "",
    ]
    paths = []
    for suffix, text in ((".json", json.dumps(record, indent=2, default=str) + "\n"), (".md", "\n".join(md))):
        path = os.path.join(out_dir, name + suffix)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths[0], paths[1]
