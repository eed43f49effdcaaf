"""Ridge experiment (ranking of poolings), figures, and the torch-free import of hf_spectral.rmt."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hf_spectral
from hf_spectral.rmt import (
    PrefixCorrelation,
    harmonic_causal_weights,
    mean_pooling_weights,
    optimal_pooling_weights,
    ridge_fit,
    ridge_pooling_experiment,
    rho_sweep,
    simulate_spectrum,
    summarise_accuracy,
    summarise_sweep,
)


def test_ridge_fit_solves_the_normal_equations_in_both_forms():
    rng = np.random.default_rng(0)
    for n, d in ((50, 8), (8, 50)):
        X, y = rng.standard_normal((n, d)), rng.standard_normal(n)
        beta, b = ridge_fit(X, y, 0.3)
        Xc = X - X.mean(0)
        expected = np.linalg.solve(Xc.T @ Xc / n + 0.3 * np.eye(d), Xc.T @ (y - y.mean()) / n)
        np.testing.assert_allclose(beta, expected, atol=1e-10)
        assert b == pytest.approx(y.mean() - X.mean(0) @ beta)
    with pytest.raises(ValueError):
        ridge_fit(X, y[:-1], 1.0)


def test_optimal_beats_causal_beats_mean_when_the_signal_is_early():
    T, L = 32, 4
    model = PrefixCorrelation(T, L)
    poolings = {"mean": mean_pooling_weights(T), "causal": harmonic_causal_weights(T),
                "optimal": optimal_pooling_weights(model.matrix)}
    rows = ridge_pooling_experiment(poolings, model, [0.3], dim=120, delta=0.5, gamma=0.5, n_test=1500,
                                    seeds=(0, 1, 2))
    accuracy = {row["pooling"]: row["accuracy_mean"] for row in summarise_accuracy(rows)}
    assert accuracy["optimal"] > accuracy["causal"] + 0.02
    assert accuracy["causal"] > accuracy["mean"] + 0.02
    paired = {name: np.array([r["accuracy"] for r in rows if r["pooling"] == name]) for name in poolings}
    assert np.all(paired["optimal"] > paired["mean"])


def test_figures_are_written(tmp_path):
    from hf_spectral.rmt.plots import plot_accuracy, plot_overlap_sweep, plot_spectrum

    T = 16
    model = PrefixCorrelation(T, 2)
    w = harmonic_causal_weights(T)
    result = simulate_spectrum(w, model, dim=100, delta=0.5, gamma=0.5, mu_norm2=1.5, seed=0)
    plot_spectrum(result.eigenvalues, result.delta, result.gamma, result.kappa, rho=result.rho,
                  path=str(tmp_path / "spectrum.png"))
    summary = summarise_sweep(rho_sweep(w, model, [1.0, 3.0], dim=100, delta=0.5, gamma=0.5, seeds=(0, 1)))
    plot_overlap_sweep(summary, 0.5, 0.5, path=str(tmp_path / "overlap.png"))
    rows = ridge_pooling_experiment({"mean": mean_pooling_weights(T), "optimal": optimal_pooling_weights(model.matrix)},
                                    model, [0.2, 0.8], dim=40, delta=0.5, gamma=0.5, n_test=100, seeds=(0, 1))
    plot_accuracy(summarise_accuracy(rows), path=str(tmp_path / "accuracy.png"))
    for name in ("spectrum.png", "overlap.png", "accuracy.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_rmt_imports_without_torch():
    # the parent package imports torch (models), so load hf_spectral.rmt under a stub parent
    script = textwrap.dedent(
        f"""
        import sys, types
        sys.modules["torch"] = None
        parent = types.ModuleType("hf_spectral")
        parent.__path__ = [{hf_spectral.__path__[0]!r}]
        sys.modules["hf_spectral"] = parent
        import hf_spectral.rmt as rmt
        import hf_spectral.rmt.plots
        assert rmt.pooling_snr(rmt.mean_pooling_weights(4), rmt.PrefixCorrelation(4, 2).matrix).ratio == 1.5
        try:
            rmt.fit_rmt_pooling
        except ImportError:
            pass
        else:
            raise AssertionError("the model tools should need torch")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
