"""The tables and figures of ``reproduce_ega_context``, from the files its run_clm runs wrote: BASE against EGA-1
(causal) per corpus and context (validation loss, Δ paired by seed), the same per group of window positions, and
the τ study (where τ goes from each initial value).

Δ = BASE − EGA-1, positive: EGA-1 better. Position groups: the buckets of run_clm's --position_loss_buckets
(``<first>-<last>`` positions of the predicted token) merged into 1 .. W−1, W .. 2W−1, 2W .. 4W−1, ... (W: the width
of a bucket), so that the groups are the same positions at every context and a group's loss is the mean over its
predictions. Only complete runs are read; while some are missing the tables say they are partial.
"""

from __future__ import annotations

import os
import statistics

from . import ega
from .cli import UsageError
from .experiments import mean_std, paired_delta, pm

PAPER_TAU = 0.35  # SPEC 1.4: "τ converges to ≈ 0.35"


def signed(delta: dict | None, digits: int = 3) -> str:
    """A paired delta (`experiments.paired_delta`) as ``+mean ± std`` (the mean alone with one seed)."""
    if not delta:
        return ""
    return f"{delta['mean']:+.{digits}f}" + ("" if delta["std"] is None else f" ± {delta['std']:.{digits}f}")


def position_groups(position_loss: dict) -> list:
    """``{"<first>-<last>": loss}`` -> [(first, last, loss)] of the position groups (1 .. W−1, W .. 2W−1,
    2W .. 4W−1, ...), each the mean over its predictions."""
    buckets = sorted((int(first), int(last), loss) for first, last, loss in
                     (key.split("-") + [value] for key, value in position_loss.items()))
    if len(buckets) < 2:
        return buckets
    width = buckets[1][0]
    groups = {}
    for first, last, loss in buckets:
        index = 0 if first < width else (first // width).bit_length()
        groups.setdefault(index, []).append((first, last, loss))
    merged = []
    for _, members in sorted(groups.items()):
        count = sum(last - first + 1 for first, last, _ in members)
        merged.append((members[0][0], members[-1][1],
                       sum((last - first + 1) * loss for first, last, loss in members) / count))
    return merged


def group_label(first: int, last: int) -> str:
    return f"{first}-{last}"


def final_gates(history: list) -> dict:
    """τ and α per layer and head at the last training log entry that has them."""
    entries = [entry for entry in history if any(key.startswith("gates/") for key in entry)]
    return {key: value for key, value in (entries[-1] if entries else {}).items() if key.startswith("gates/")}


def tau_trajectory(history: list) -> list:
    """[(step, mean τ, min τ, max τ)] over the heads, at every log entry with the gates."""
    rows = []
    for entry in history:
        taus = [value for key, value in entry.items() if key.startswith("gates/") and key.endswith("/tau")]
        if taus:
            rows.append((entry["step"], statistics.fmean(taus), min(taus), max(taus)))
    return rows


def recorded_sweep_runs(path: str, sweep: dict) -> dict:
    """{key: `ega.RecordedRun`} for the runs of ``sweep`` not complete here that the ``context_sweep.json`` at
    ``path`` holds (by name), so that a sweep spread over several machines or sittings goes on from the table of
    record. Each must have been made with the arguments planned here: a run the record gives its arguments is
    compared argument by argument; for a run of an earlier record without them, the record's configuration (the
    arguments of its first run) is compared with that run's here, and the run's corpus, context, batch, steps, arm and
    seed with its own. Otherwise a `UsageError` names the difference."""
    record, held, recorded_config = ega.read_record(path)
    # The sweep's first runs were recorded before run_clm had char_eos_and_pad, with the vocabulary it now leaves off
    for found in held.values():
        if "arguments" in found:
            found["arguments"] = {"char_eos_and_pad": False, **found["arguments"]}
    recorded_config = {"char_eos_and_pad": False, **recorded_config}
    wanted = {key: run for key, run in sweep.items() if not run.complete and run.name in held}
    differences = []
    if any("arguments" not in held[run.name] for run in wanted.values()):
        def tail(folder: str) -> tuple:
            return tuple(str(folder).split(os.sep)[-3:])

        same = next((run for run in sweep.values() if tail(run.folder) == tail(recorded_config.get("output_dir"))),
                    None)
        if same is None:
            raise UsageError(f"--add_to_results {path}: its configuration is of no run planned here "
                             f"({recorded_config.get('output_dir')})")
        differences += ega.argument_differences(recorded_config, same.arguments, ignore=("output_dir",))
    for (benchmark, context, variant, normalization, seed), run in wanted.items():
        entry = held[run.name]
        if "arguments" in entry:
            differences += [f"{run.name}: {difference}" for difference in ega.argument_differences(
                entry["arguments"], run.arguments)]
            continue
        planned = {"benchmark": benchmark, "context": context, "variant": variant, "normalization": normalization,
                   "seed": seed, "steps": run.arguments["max_steps"],
                   "batch_size": run.arguments["per_device_train_batch_size"]}
        differences += [f"{run.name}: {key} {entry.get(key)!r} there, {value!r} here"
                        for key, value in planned.items() if entry.get(key) != value]
    if differences:
        raise UsageError(f"--add_to_results {path} holds runs made with other arguments ({'; '.join(differences)})")
    return {key: ega.RecordedRun(run.name, run.script, run.arguments, recorded=held[run.name], source=record)
            for key, run in wanted.items()}


def sweep_summaries(sweep: dict) -> list:
    summaries = []
    for (benchmark, context, variant, normalization, seed), run in sweep.items():
        if not run.complete:
            continue
        if isinstance(run, ega.RecordedRun):  # read from a table of record: its summary, as that table wrote it
            found = {key: value for key, value in run.recorded.items() if key != "arguments"}
            found.update(arguments=run.arguments)
            summaries.append(found)
            continue
        found = ega.summary(run, variant, normalization, seed)
        found.update(benchmark=benchmark, context=context, arguments=run.arguments, batch_size=run.arguments["per_device_train_batch_size"],
                     tokens_per_step=context * run.arguments["per_device_train_batch_size"])
        if found.get("position_loss"):
            found["position_groups"] = [[first, last, loss] for first, last, loss in
                                        position_groups(found["position_loss"])]
        summaries.append(found)
    return summaries


def comparison(summaries: list) -> tuple:
    """Rows per (corpus, context) and the paired deltas, overall and per position group."""
    cells = {}
    for found in summaries:
        cells.setdefault((found["benchmark"], found["context"]), {}).setdefault(found["variant"], {})[
            found["seed"]] = found
    rows, paired, positions = [], {}, {}
    for (benchmark, context), arms in sorted(cells.items(), key=lambda item: (list(ega.TITLES).index(item[0][0])
                                                                              if item[0][0] in ega.TITLES else 99,
                                                                              item[0][1])):
        base, gated = arms.get("BASE", {}), arms.get("EGA-1", {})
        key = f"{benchmark} context {context}"
        delta = paired_delta({s: f["val_loss"] for s, f in base.items()}, {s: f["val_loss"] for s, f in gated.items()})
        paired[key] = delta
        base_val, base_std = mean_std([f["val_loss"] for f in base.values()])
        ega_val, ega_std = mean_std([f["val_loss"] for f in gated.values()])
        tau, tau_std = mean_std([f["gates"]["tau_mean"] for f in gated.values() if f.get("gates")])
        minutes = {name: mean_std([(f["train_seconds"] or 0) / 60 for f in arm.values()])[0]
                   for name, arm in (("BASE", base), ("EGA-1", gated))}
        # per position group: BASE − EGA-1 paired by seed, and late − early (the last group's Δ − the first's)
        groups = {}
        for arm_name, arm in (("BASE", base), ("EGA-1", gated)):
            for seed, found in arm.items():
                for first, last, loss in found.get("position_groups", []):
                    groups.setdefault(group_label(first, last), {}).setdefault(arm_name, {})[seed] = loss
        by_group = {label: {"base": mean_std(list(arm.get("BASE", {}).values()))[0],
                            "delta": paired_delta(arm.get("BASE", {}), arm.get("EGA-1", {}))}
                    for label, arm in groups.items()}
        late_minus_early = None  # Δ_last − Δ_first = (EGA_first − EGA_last) − (BASE_first − BASE_last), per seed
        if len(groups) > 1:
            labels = list(groups)
            first, last = groups[labels[0]], groups[labels[-1]]
            late_minus_early = paired_delta(
                {s: first["EGA-1"][s] - last["EGA-1"][s] for s in first.get("EGA-1", {})
                 if s in last.get("EGA-1", {})},
                {s: first["BASE"][s] - last["BASE"][s] for s in first.get("BASE", {}) if s in last.get("BASE", {})})
        positions[key] = {"benchmark": benchmark, "context": context, "groups": by_group,
                          "late_minus_early": late_minus_early}
        rows.append({
            "corpus": ega.TITLES.get(benchmark, benchmark), "context": context,
            "batch": next(iter({**base, **gated}.values()))["batch_size"],
            "seeds (BASE / EGA-1)": f"{len(base)} / {len(gated)}",
            "BASE val loss": pm(base_val, base_std), "EGA-1 val loss": pm(ega_val, ega_std),
            "Δ paired": signed(delta),
            "Δ per seed": "" if delta is None else ", ".join(f"{value:+.3f}" for value in delta["per_seed"]),
            "late − early Δ": signed(late_minus_early),
            "EGA-1 τ (mean)": pm(tau, tau_std, 3),
            "train min / run (BASE / EGA-1)": " / ".join("" if value is None else f"{value:.1f}"
                                                         for value in minutes.values()),
            "benchmark": benchmark, "base_val_mean": base_val, "base_val_std": base_std, "ega_val_mean": ega_val,
            "ega_val_std": ega_std, "delta": delta, "tau_mean": tau, "tau_std": tau_std,
        })
    return rows, paired, positions


def trend(rows: list) -> list:
    """Per corpus: the least-squares slope of the per-seed Δ against log2(context) (nats per doubling of the context)
    over every (context, seed) point, its standard error and t (n − 2 degrees of freedom), and the difference between
    the mean Δ at the longest and at the shortest context with its Welch t."""
    import math

    found = []
    for corpus in dict.fromkeys(row["corpus"] for row in rows):
        cells = [row for row in rows if row["corpus"] == corpus and row["delta"]]
        points = [(math.log2(row["context"]), value) for row in cells for value in row["delta"]["per_seed"]]
        result = {"corpus": corpus, "contexts": [row["context"] for row in cells], "points": len(points),
                  "slope": None, "slope_se": None, "slope_t": None, "last_minus_first": None, "welch_t": None}
        xs = [x for x, _ in points]
        if len({*xs}) > 1 and len(points) > 2:
            mean_x, mean_y = statistics.fmean(xs), statistics.fmean(y for _, y in points)
            sxx = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
            residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points) / (len(points) - 2)
            se = math.sqrt(residual / sxx)
            result.update(slope=slope, slope_se=se, slope_t=slope / se if se > 0 else None)
        if len(cells) > 1:
            first, last = cells[0]["delta"], cells[-1]["delta"]
            result["last_minus_first"] = last["mean"] - first["mean"]
            if first["std"] is not None and last["std"] is not None:
                spread = math.sqrt(first["std"] ** 2 / len(first["per_seed"]) + last["std"] ** 2 / len(last["per_seed"]))
                result["welch_t"] = result["last_minus_first"] / spread if spread > 0 else None
        found.append(result)
    return found


def trend_table(trends: list) -> str:
    from ..results import markdown_table

    def number(value, digits=4, sign=True):
        return "" if value is None else f"{value:{'+' if sign else ''}.{digits}f}"

    rows = [{"corpus": one["corpus"], "contexts": ", ".join(map(str, one["contexts"])), "points (context × seed)":
             one["points"], "slope of Δ per doubling": number(one["slope"]), "its SE": number(one["slope_se"],
                                                                                               sign=False),
             "t (n − 2 df)": number(one["slope_t"], 2), "Δ longest − Δ shortest": number(one["last_minus_first"]),
             "Welch t": number(one["welch_t"], 2)} for one in trends]
    return markdown_table(rows)


COLUMNS = ["corpus", "context", "batch", "seeds (BASE / EGA-1)", "BASE val loss", "EGA-1 val loss", "Δ paired",
           "Δ per seed", "late − early Δ", "EGA-1 τ (mean)", "train min / run (BASE / EGA-1)"]


def position_table(positions: dict) -> str:
    """Markdown: per corpus, one row per context, one column per position group: Δ (mean ± std over seeds), and
    BASE's loss there."""
    from ..results import markdown_table

    text = []
    for benchmark in dict.fromkeys(cell["benchmark"] for cell in positions.values()):
        cells = [cell for cell in positions.values() if cell["benchmark"] == benchmark]
        labels = sorted({label for cell in cells for label in cell["groups"]}, key=lambda label: int(label.split("-")[0]))
        rows, base_rows = [], []
        for cell in cells:
            row, base_row = {"context": cell["context"]}, {"context": cell["context"]}
            for label in labels:
                group = cell["groups"].get(label)
                delta = group and group["delta"]
                row[label] = signed(delta)
                base_row[label] = "" if not group or group["base"] is None else f"{group['base']:.3f}"
            rows.append(row)
            base_rows.append(base_row)
        title = ega.TITLES.get(benchmark, benchmark)
        text += [f"### {title}: Δ by position of the predicted token (BASE − EGA-1, paired by seed)", "",
                 markdown_table(rows, ["context", *labels]),
                 f"{title}: BASE's loss by position (mean over seeds)", "", markdown_table(base_rows, ["context", *labels])]
    return "\n".join(text)


def tau_summaries(taus: dict) -> list:
    summaries = []
    for init, run in taus.items():
        if not run.complete:
            continue
        found = ega.summary(run, "EGA-1", "causal", run.arguments["seed"])
        found["arguments"] = run.arguments
        trajectory = tau_trajectory(found["log_history"])
        steps = run.arguments["max_steps"]

        def tau_at(fraction: float):
            eligible = [row for row in trajectory if row[0] <= fraction * steps]
            return eligible[-1][1] if eligible else None

        gates = final_gates(found["log_history"])
        layers = sorted({int(key.split("/")[1][1:]) for key in gates})
        found.update(
            tau_init=init, tau_trajectory=[list(row) for row in trajectory],
            tau_at={f"{fraction:g}": tau_at(fraction) for fraction in (0.25, 0.5, 0.75, 1.0)},
            tau_per_layer={layer: statistics.fmean(value for key, value in gates.items()
                                                   if key.startswith(f"gates/L{layer}/") and key.endswith("/tau"))
                           for layer in layers},
            tau_min=min((value for key, value in gates.items() if key.endswith("/tau")), default=None),
            tau_max=max((value for key, value in gates.items() if key.endswith("/tau")), default=None),
        )
        summaries.append(found)
    return sorted(summaries, key=lambda found: found["tau_init"])


def tau_rows(summaries: list) -> list:
    rows = []
    for found in summaries:
        gates, at = found.get("gates") or {}, found["tau_at"]
        late = None if None in (at["0.75"], at["1"]) else at["1"] - at["0.75"]
        rows.append({
            "τ init": f"{found['tau_init']:+g}", "steps": found["steps"],
            "τ at 25% / 50% / 75%": " / ".join("" if at[k] is None else f"{at[k]:+.3f}" for k in ("0.25", "0.5", "0.75")),
            "final τ (mean ± std over heads)": pm(gates.get("tau_mean"), gates.get("tau_std"), 3),
            "final τ range": "" if found["tau_min"] is None else f"{found['tau_min']:+.3f} .. {found['tau_max']:+.3f}",
            "final τ per layer": ", ".join(f"L{layer} {value:+.3f}" for layer, value in found["tau_per_layer"].items()),
            "moved": "" if gates.get("tau_mean") is None else f"{gates['tau_mean'] - found['tau_init']:+.3f}",
            "last 25% of steps": "" if late is None else f"{late:+.3f}",
            "final α (mean)": "" if gates.get("alpha_mean") is None else f"{gates['alpha_mean']:.3f}",
            "val loss": f"{found['val_loss']:.4f}",
        })
    return rows


TAU_COLUMNS = ["τ init", "steps", "τ at 25% / 50% / 75%", "final τ (mean ± std over heads)", "final τ range",
               "final τ per layer", "moved", "last 25% of steps", "final α (mean)", "val loss"]


def write_report(sweep: dict, taus: dict, results_dir: str, preset: str, tau_corpus: str) -> bool:
    """``context_sweep.{json,md}``, ``delta_vs_context.png``, ``position_delta.png``; ``tau_init.{json,md}``,
    ``tau_trajectories.png``: from the complete runs (a table of partial runs says so). False when no run is complete."""
    from ..results import write_results
    from .plots import plot_delta_vs_context, plot_position_deltas, plot_tau_trajectories

    wrote = False
    summaries = sweep_summaries(sweep)
    complete, planned = len(summaries), len(sweep)
    if summaries:
        rows, paired, positions = comparison(summaries)
        trends = trend(rows)
        status = "" if complete == planned else f" (partial: {complete} of {planned} runs complete)"
        extra, provenance = ega.recorded_provenance([run for run in sweep.values()
                                                     if isinstance(run, ega.RecordedRun)])
        first = min(summaries, key=lambda found: (found["context"], found["seed"]))
        arguments = first["arguments"]
        contexts = sorted({found["context"] for found in summaries})
        notes = (
            f"BASE vs EGA-1 (causal statistics), {preset} configuration at each context: the same model and steps "
            f"({arguments['config_overrides']}, max_position_embeddings = the context; {arguments['max_steps']} steps, "
            f"{arguments['warmup_steps']} warm-up, {arguments['lr_scheduler_type']}, lr {arguments['learning_rate']}), "
            f"{first['tokens_per_step']} tokens per step (batch = {first['tokens_per_step']} / context). Validation "
            "loss in nats per character at the final step on the whole validation split (evaluation mode), mean ± "
            "sample std over seeds; Δ = BASE − EGA-1 paired by seed, mean ± std of the per-seed differences "
            "(positive: EGA-1 better). late − early Δ: the Δ of the last position group minus that of the first "
            "(positions 1 .. W−1), paired by seed (positive: the gate helps late positions more). τ: the mean over "
            "layers and heads of EGA-1's learned threshold at the end (initial 0)."
            + (f"\n\n**Partial**: {complete} of {planned} planned runs are complete; the others are left out."
               if status else "")
            + provenance
            + "\n\n### Does Δ grow with the context? (per corpus; Δ per seed against log2 context)\n\n"
            + trend_table(trends) + "\n" + position_table(positions))
        write_results(results_dir, "context_sweep", rows, title=f"EGA-1 vs BASE by context length{status}",
                      config=arguments, seeds=sorted({found["seed"] for found in summaries}), notes=notes,
                      columns=COLUMNS,
                      extra={**extra, "complete_runs": complete, "planned_runs": planned, "contexts": contexts,
                             "paired_deltas": paired, "trend": trends, "position_deltas": positions,
                             "runs": [{key: value for key, value in found.items() if key != "log_history"}
                                      for found in summaries]})
        deltas = {}
        for row in rows:
            if row["delta"]:
                deltas.setdefault(row["corpus"], []).append((row["context"], row["delta"]))
        plot_delta_vs_context(
            deltas, os.path.join(results_dir, "delta_vs_context.png"),
            f"Δ = BASE − EGA-1 (causal) by context, {first['tokens_per_step']} tokens per step{status}")
        plot_position_deltas(positions, os.path.join(results_dir, "position_delta.png"),
                             f"Δ (BASE − EGA-1) by position of the predicted token{status}", ega.TITLES)
        print(f"context sweep: {results_dir}/context_sweep.{{json,md}}{status}")
        wrote = True
    tau = tau_summaries(taus)
    if tau:
        status = "" if len(tau) == len(taus) else f" (partial: {len(tau)} of {len(taus)} runs complete)"
        arguments = tau[0]["arguments"]
        sweep_taus = {}  # (corpus, context) -> the final mean τ of each seed's EGA-1
        for found in summaries:
            if found.get("gates"):
                sweep_taus.setdefault((found["benchmark"], found["context"]), []).append(found["gates"]["tau_mean"])
        heads = len([key for key in final_gates(tau[0]["log_history"]) if key.endswith("/tau")])
        finals = [found["gates"]["tau_mean"] for found in tau if found.get("gates")]
        spread = {"start": max(found["tau_init"] for found in tau) - min(found["tau_init"] for found in tau),
                  "end": max(finals) - min(finals) if finals else None,
                  "mean_end": statistics.fmean(finals) if finals else None}
        notes = (
            f"EGA-1 (causal) on {ega.TITLES.get(tau_corpus, tau_corpus)} at context "
            f"{arguments['block_size']}, batch {arguments['per_device_train_batch_size']}, {arguments['max_steps']} "
            f"steps ({arguments['warmup_steps']} warm-up, {arguments['lr_scheduler_type']}, lr "
            f"{arguments['learning_rate']}, no weight decay on τ), seed {arguments['seed']}, from each initial τ "
            f"(gate_tau_init, every head; α from 2). τ: the mean over the {heads} heads of the learned threshold, logged "
            f"every {arguments['logging_steps']} steps. moved: final − initial; last 25% of steps: the change of the "
            f"mean τ over the last quarter of training (the learning rate decays to 0 there). Paper: τ converges to "
            f"≈ {PAPER_TAU} whatever its start (SPEC 1.4)."
            + (f"\n\nSpread of the mean τ over the starts: {spread['start']:.3f} at the start, "
               f"{spread['end']:.3f} at the end (mean of the final values {spread['mean_end']:+.3f})."
               if len(finals) > 1 else "")
            + (f"\n\n**Partial**: {len(tau)} of {len(taus)} τ runs are complete." if status else "")
            + ("\n\nEGA-1's final τ (mean over heads) in the context sweep, from 0: "
               + "; ".join(f"{ega.TITLES.get(corpus, corpus)} context {context}: {pm(*mean_std(values), 3)}"
                           for (corpus, context), values in sweep_taus.items()) if sweep_taus else ""))
        write_results(results_dir, "tau_init", tau_rows(tau), title=f"Where EGA-1's threshold τ goes from its start{status}",
                      config=arguments, seeds=[arguments["seed"]], notes=notes, columns=TAU_COLUMNS,
                      extra={"complete_runs": len(tau), "planned_runs": len(taus), "paper_tau": PAPER_TAU,
                             "spread": spread,
                             "runs": [{key: value for key, value in found.items()
                                       if key not in ("log_history", "arguments")} for found in tau]})
        plot_tau_trajectories({f"τ init {found['tau_init']:+g}": found["tau_trajectory"] for found in tau},
                              PAPER_TAU, os.path.join(results_dir, "tau_trajectories.png"),
                              f"EGA-1's τ (mean over heads, band: min-max) from each start{status}")
        print(f"τ study: {results_dir}/tau_init.{{json,md}}{status}")
        wrote = True
    if not wrote:
        print("no run is complete yet: no table written")
    return wrote
