"""The energy-gate tensor functions (hf_spectral/models/ega_gpt/energy_gate.py) against direct computations."""

import math

import numpy as np
import pytest
import pywt
import torch

from hf_spectral.models.ega_gpt.energy_gate import (
    DerivedTensors,
    EnergyGate,
    caching_derived_tensors,
    causal_filter,
    daubechies_kernels,
    fold_bias_into_qkv,
    log_gate_bias,
    morlet_kernels,
    normalize_energy,
    causal_zscore,
    folded_output_weight,
    folded_qkv_weights,
)


def _padded_energy(seed=0, batch=3, heads=2, scales=2, length=11):
    generator = torch.Generator().manual_seed(seed)
    energy = torch.randn(batch, heads, scales, length, generator=generator) * 3 + 5
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[1, -3:] = False  # right padding
    return energy, valid


def test_causal_normalisation_uses_only_the_valid_prefix():
    energy, valid = _padded_energy()
    z = normalize_energy(energy, valid, "causal", eps=1e-5)
    for b in range(energy.shape[0]):
        seen = []
        for t in range(energy.shape[-1]):
            if not valid[b, t]:
                assert torch.all(z[b, ..., t] == 0)
                continue
            seen.append(t)
            if len(seen) < 2:
                assert torch.all(z[b, ..., t] == 0)
                continue
            prefix = energy[b, ..., seen].double()
            expected = (energy[b, ..., t].double() - prefix.mean(-1)) / prefix.std(-1).clamp(min=1e-5)
            torch.testing.assert_close(z[b, ..., t].double(), expected, atol=1e-5, rtol=1e-5)


def test_causal_normalisation_is_stable_far_from_zero():
    # A large common offset must not destroy the variance (running sums are shifted by the first token).
    energy, valid = _padded_energy()
    z = normalize_energy(energy, valid, "causal")
    shifted = normalize_energy(energy + 1e4, valid, "causal")
    torch.testing.assert_close(z, shifted, atol=2e-3, rtol=0)


def test_window_normalisation_uses_every_valid_position():
    energy, valid = _padded_energy()
    z = normalize_energy(energy, valid, "window")
    for b in range(energy.shape[0]):
        window = energy[b][..., valid[b]].double()
        expected = (energy[b].double() - window.mean(-1, keepdim=True)) / window.std(-1, keepdim=True)
        torch.testing.assert_close(z[b][..., valid[b]].double(), expected[..., valid[b]], atol=1e-5, rtol=1e-5)
        assert torch.all(z[b][..., ~valid[b]] == 0)


def test_running_moments_continue_across_chunks():
    """Moments carried from a past chunk (as the KV cache carries them) give the whole sequence's z-scores."""
    energy, valid = _padded_energy(length=13)
    z, mean, m2 = causal_zscore(energy, valid)
    for split in (1, 5, 12):
        past = (valid[:, :split].sum(-1), mean[..., split - 1 : split], m2[..., split - 1 : split])
        z2, mean2, m2_2 = causal_zscore(energy[..., split:], valid[:, split:], past)
        torch.testing.assert_close(z2, z[..., split:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mean2, mean[..., split:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m2_2, m2[..., split:], atol=1e-4, rtol=1e-5)


def test_unknown_normalisation_is_refused():
    with pytest.raises(ValueError, match="normalisation"):
        normalize_energy(torch.zeros(1, 1, 1, 3), None, "global")


def test_gate_bias_is_log_of_the_mixture_of_sigmoids():
    generator = torch.Generator().manual_seed(1)
    z = torch.randn(2, 3, 4, 7, generator=generator)
    tau, alpha, mix = (torch.randn(3, 4, generator=generator) for _ in range(3))
    bias, gate = log_gate_bias(z, tau, alpha, mix)
    weights = torch.softmax(mix, -1)[None, :, :, None]
    expected_gate = (weights * torch.sigmoid(alpha[..., None] * (z - tau[..., None]))).sum(2)
    torch.testing.assert_close(gate, expected_gate)
    at_mean = (weights[..., 0] * torch.sigmoid(-alpha * tau)[None]).sum(-1)
    torch.testing.assert_close(bias, torch.log(expected_gate) - torch.log(at_mean)[..., None])


def test_gate_bias_is_exactly_zero_when_alpha_is_zero():
    z = torch.randn(2, 3, 1, 5) * 10
    bias, gate = log_gate_bias(z, torch.randn(3, 1), torch.zeros(3, 1), torch.zeros(3, 1))
    assert torch.all(bias == 0)
    assert torch.all(gate == 0.5)


@pytest.mark.parametrize("width", [1, 3])
def test_folded_bias_equals_gating_and_renormalising_the_attention(width):
    """softmax(q'k'ᵀ·s) over folded q/k equals A_ij g_j / Σ_k A_ik g_k computed the long way."""
    generator = torch.Generator().manual_seed(2)
    batch, heads, length, dim = 2, 3, 6, 4
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64) for _ in range(3))
    gate = torch.rand(batch, heads, length, generator=generator, dtype=torch.float64) * 0.98 + 0.01
    scaling = dim**-0.5
    aux = torch.randn(batch, heads, length, width, generator=generator, dtype=torch.float64) if width > 1 else None
    causal = torch.ones(length, length, dtype=torch.bool).tril()

    attention = torch.softmax((q @ k.transpose(-1, -2) * scaling).masked_fill(~causal, -math.inf), -1)
    gated = attention * gate[:, :, None, :]
    expected = (gated / gated.sum(-1, keepdim=True)) @ v

    q2, k2, v2 = fold_bias_into_qkv(q, k, v, torch.log(gate), scaling, aux)
    assert q2.shape[-1] == k2.shape[-1] == v2.shape[-1] == dim + width
    folded = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=scaling)
    torch.testing.assert_close(folded[..., :dim], expected)
    if aux is not None:  # the extra value channels carry the aux state through unchanged in the cache
        torch.testing.assert_close(v2[..., dim:], aux)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("width", [1, 3])
def test_projections_in_the_folded_layout_equal_folding_after_projecting(width, with_bias):
    """The fused path (padded weights, bias and state written in place) gives fold_bias_into_qkv's q', k', v' and,
    after attention, the same output projection as cutting the extra channels off first."""
    generator = torch.Generator().manual_seed(4)
    batch, length, heads, dim = 2, 5, 3, 4
    hidden = heads * dim
    x = torch.randn(batch, length, hidden, generator=generator, dtype=torch.float64)
    c_attn = torch.nn.Linear(hidden, 3 * hidden, bias=with_bias, dtype=torch.float64)
    c_proj = torch.nn.Linear(hidden, hidden, bias=with_bias, dtype=torch.float64)
    bias = torch.randn(batch, heads, length, generator=generator, dtype=torch.float64)
    aux = torch.randn(batch, heads, length, width, generator=generator, dtype=torch.float64) if width > 1 else None
    scaling = dim**-0.5

    q, k, v = (t.view(batch, length, heads, dim).transpose(1, 2) for t in c_attn(x).split(hidden, dim=2))
    expected = fold_bias_into_qkv(q, k, v, bias, scaling, aux)

    energy = torch.nn.Linear(hidden, heads * 2, bias=with_bias, dtype=torch.float64)
    weight, padded_bias = folded_qkv_weights(
        c_attn.weight, c_attn.bias, heads, dim, width, scaling, energy.weight, energy.bias
    )
    projected = torch.nn.functional.linear(x, weight, padded_bias)
    columns = 3 * heads * (dim + width)
    torch.testing.assert_close(projected[..., columns:], energy(x))  # the appended rows compute the energies
    qkv = projected[..., :columns].view(batch, length, 3, heads, dim + width)
    qkv[:, :, 1, :, dim] = bias.transpose(1, 2)
    if aux is not None:
        qkv[:, :, 2, :, dim:] = aux.transpose(1, 2)
    for got, want in zip(qkv.permute(2, 0, 3, 1, 4).unbind(0), expected):
        torch.testing.assert_close(got, want)

    out = torch.randn(batch, length, heads, dim + width, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(
        torch.nn.functional.linear(out.reshape(batch, length, -1), folded_output_weight(c_proj.weight, heads, width),
                                   c_proj.bias),
        c_proj(out[..., :dim].reshape(batch, length, hidden)),
    )


def test_derived_tensors_are_kept_only_inside_the_caching_block_and_follow_their_sources():
    weight = torch.nn.Parameter(torch.randn(3, 2))
    derived, builds = DerivedTensors(), []

    def build():
        builds.append(1)
        return weight * 2

    with torch.no_grad():
        assert derived.get(build, "key", weight) is not derived.get(build, "key", weight)  # outside: never kept
        assert len(builds) == 2
        with caching_derived_tensors():
            first = derived.get(build, "key", weight)
            assert derived.get(build, "key", weight) is first and len(builds) == 3
            assert derived.kept("key") is first and derived.kept("other key") is DerivedTensors.MISSING
            second = derived.get(build, "other key", weight)
            assert second is not first and len(builds) == 4 and derived.kept("other key") is second
            weight.add_(1.0)  # an in-place update: the version counter moves
            assert derived.kept("other key") is DerivedTensors.MISSING
            torch.testing.assert_close(derived.get(build, "other key", weight), weight * 2)
            weight.data = torch.zeros(3, 2)  # replaced storage (e.g. .to() / .half())
            assert torch.all(derived.get(build, "other key", weight) == 0) and len(builds) == 6
            with torch.enable_grad():  # autograd on: derived again, differentiable
                assert derived.get(build, "other key", weight).requires_grad and len(builds) == 7
        assert derived.derived is None and derived.kept("other key") is DerivedTensors.MISSING  # dropped on leaving


def test_causal_filter_matches_direct_convolution():
    generator = torch.Generator().manual_seed(3)
    signal = torch.randn(2, 9, generator=generator, dtype=torch.float64)
    kernels = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    out = causal_filter(signal, kernels)
    for c in range(3):
        for t in range(9):
            expected = sum(kernels[c, u] * signal[:, t - u] for u in range(4) if t - u >= 0)
            torch.testing.assert_close(out[:, c, t], expected)


def test_morlet_kernels_follow_the_definition():
    omega = torch.tensor([[math.pi / 3, math.pi / 7]])
    sigma = 5.0 / omega
    taps = morlet_kernels(omega, sigma, [3, 7])
    assert taps.shape == (1, 2, 2, 7)
    t = torch.arange(7.0)
    for s, length in enumerate([3, 7]):
        envelope = torch.exp(-(t**2) / (2 * sigma[0, s] ** 2)) * (t < length)
        torch.testing.assert_close(taps[0, s, 0], torch.cos(omega[0, s] * t) * envelope)
        torch.testing.assert_close(taps[0, s, 1], torch.sin(omega[0, s] * t) * envelope)


def test_daubechies_kernels_are_dilated_pywavelets_high_pass_taps():
    kernels = daubechies_kernels("db2", [1, 2, 4, 8])
    taps = np.array(pywt.Wavelet("db2").dec_hi)
    for row, dilation in enumerate([1, 2, 4, 8]):
        expected = np.zeros(kernels.shape[1])
        expected[: (len(taps) - 1) * dilation + 1 : dilation] = taps
        np.testing.assert_allclose(kernels[row].numpy(), expected, rtol=1e-6)


def test_ega1_has_260_parameters_per_head_at_c256():
    gate = EnergyGate(256, 8, kind="linear", projections=1)
    assert sum(p.numel() for p in gate.parameters()) == 260 * 8


@pytest.mark.parametrize("kind", ["linear", "conv", "morlet", "db2", "db4"])
def test_gate_is_causal_and_incremental_for_every_energy(kind):
    """Energies, gates and cached state computed step by step equal the full-sequence computation."""
    torch.manual_seed(4)
    gate = EnergyGate(16, 2, kind=kind, projections=2, scales=None if kind == "linear" else [3, 5], alpha_init=1.5)
    x = torch.randn(2, 12, 16)
    bias, values, aux = gate(x, return_aux=True)
    state, pieces = None, []
    for t in range(12):
        step_bias, _, step_aux = gate(x[:, t : t + 1], past_aux=state, return_aux=True)
        state = step_aux if state is None else torch.cat([state, step_aux], dim=2)
        pieces.append(step_bias)
    torch.testing.assert_close(torch.cat(pieces, -1), bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, aux, atol=1e-6, rtol=1e-6)
    # Changing the future leaves past gates untouched.
    changed = x.clone()
    changed[:, 7:] = torch.randn(2, 5, 16)
    torch.testing.assert_close(gate(changed)[0][..., :7], bias[..., :7], atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["causal", "window"])
def test_gradients_stay_finite_where_the_std_is_zero(mode):
    # One-token prefixes and constant energies have zero variance; the eps floor must not produce NaN gradients.
    energy = torch.cat([torch.full((1, 1, 1, 4), 2.0), torch.randn(1, 1, 1, 4)], -1).requires_grad_()
    valid = torch.tensor([[False, True, True, True, True, True, True, True]])
    normalize_energy(energy, valid, mode).sum().backward()
    assert torch.isfinite(energy.grad).all()
