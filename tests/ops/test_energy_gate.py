"""The energy-gate tensor functions and module (hf_spectral/ops/energy_gate.py) against direct computations."""

import math
import sys

import numpy as np
import pytest
import pywt
import torch

from hf_spectral.ops.energy_gate import (
    DaubechiesEnergy,
    EnergyGate,
    causal_filter,
    causal_zscore,
    daubechies_kernels,
    default_scales,
    log_gate_bias,
    morlet_kernels,
    normalize_energy,
    padding_mask,
    token_weight,
)


def _padded_energy(seed=0, batch=3, heads=2, scales=2, length=11):
    generator = torch.Generator().manual_seed(seed)
    energy = torch.randn(batch, heads, scales, length, generator=generator) * 3 + 5
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[1, -3:] = False  # right padding
    return energy, valid


# (scale, offset, atol): energies of ordinary spread, of a std between ε and √ε (where a floor on the variance
# instead of the std would act) and of a std below ε = 1e-5 (where the std's floor ε acts).
SPREADS = [(3.0, 5.0, 1e-5), (1e-3, 5.0, 2e-3), (1e-7, 0.0, 1e-4)]


@pytest.mark.parametrize("scale, offset, atol", SPREADS, ids=["spread", "small-std", "below-eps"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_causal_normalisation_uses_only_the_valid_prefix(padded, scale, offset, atol):
    energy, valid = _padded_energy()
    energy = (energy - 5) / 3 * scale + offset
    if not padded:  # the unpadded path (no mask): its own arithmetic, against the same reference
        valid = torch.ones_like(valid)
    z = normalize_energy(energy, valid if padded else None, "causal", eps=1e-5)
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
            torch.testing.assert_close(z[b, ..., t].double(), expected, atol=atol, rtol=1e-5)


def test_causal_normalisation_is_stable_far_from_zero():
    # A large common offset must not destroy the variance (running sums are shifted by the first token).
    energy, valid = _padded_energy()
    z = normalize_energy(energy, valid, "causal")
    shifted = normalize_energy(energy + 1e4, valid, "causal")
    torch.testing.assert_close(z, shifted, atol=2e-3, rtol=0)


@pytest.mark.parametrize("scale, offset, atol", SPREADS, ids=["spread", "small-std", "below-eps"])
def test_window_normalisation_uses_every_valid_position(scale, offset, atol):
    energy, valid = _padded_energy()
    energy = (energy - 5) / 3 * scale + offset
    z = normalize_energy(energy, valid, "window", eps=1e-5)
    for b in range(energy.shape[0]):
        window = energy[b][..., valid[b]].double()
        std = window.std(-1, keepdim=True).clamp(min=1e-5)
        expected = (energy[b].double() - window.mean(-1, keepdim=True)) / std
        torch.testing.assert_close(z[b][..., valid[b]].double(), expected[..., valid[b]], atol=atol, rtol=1e-5)
        assert torch.all(z[b][..., ~valid[b]] == 0)


def test_running_moments_continue_across_chunks():
    """Moments carried from a past chunk (as the KV cache carries them) give the whole sequence's z-scores; one new
    position at a time is the same function (Welford's update)."""
    energy, valid = _padded_energy(length=13)
    z, count, mean, m2 = causal_zscore(energy, token_weight(valid))
    for split in (1, 5, 12):
        past = (count[..., split - 1 : split], mean[..., split - 1 : split], m2[..., split - 1 : split])
        z2, count2, mean2, m2_2 = causal_zscore(energy[..., split:], token_weight(valid[:, split:]), past)
        torch.testing.assert_close(z2, z[..., split:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(count2, count[..., split:], atol=0, rtol=0)
        torch.testing.assert_close(mean2, mean[..., split:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m2_2, m2[..., split:], atol=1e-4, rtol=1e-5)
    # token by token, as decoding runs it
    past, pieces = None, []
    for t in range(energy.shape[-1]):
        step = causal_zscore(energy[..., t : t + 1], token_weight(valid[:, t : t + 1]), past)
        pieces.append(step[0])
        past = step[1:]
    torch.testing.assert_close(torch.cat(pieces, -1), z, atol=1e-5, rtol=1e-5)


def test_one_step_updates_stay_accurate_over_long_sequences():
    """1,024 float32 steps far from zero (|mean| ≫ std) agree with a float64 reference within float32 precision."""
    generator = torch.Generator().manual_seed(7)
    energy = torch.randn(1, 2, 1, 1024, generator=generator, dtype=torch.float64) * 0.5 + 300.0
    past, pieces = None, []
    for t in range(1024):
        step = causal_zscore(energy[..., t : t + 1].float(), None, past)
        pieces.append(step[0])
        past = step[1:]
    reference = causal_zscore(energy, None)[0]
    torch.testing.assert_close(torch.cat(pieces, -1).double(), reference, atol=2e-3, rtol=0)


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


@pytest.mark.parametrize("scales", [1, 2])  # one scale: no mixture; several: the mixture's residue is subtracted
def test_gate_bias_is_exactly_zero_for_heads_whose_alpha_is_zero_and_still_has_gradients(scales):
    z = torch.randn(2, 3, scales, 5) * 10
    alpha = torch.zeros(3, scales)
    alpha[2] = 1.0  # the last head is gated
    alpha.requires_grad_()
    bias, _ = log_gate_bias(z, torch.randn(3, scales), alpha, torch.randn(3, scales))
    assert torch.all(bias[:, :2] == 0) and torch.all(bias[:, 2] != 0)
    (bias * torch.randn_like(bias)).sum().backward()
    assert torch.all(alpha.grad[:2] != 0)  # the exact zero does not cut α off from training


def test_padding_mask_reads_2d_and_4d_masks():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(padding_mask(mask), mask.bool())
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    four_d = (causal[None, None] & mask.bool()[:, None, None, :])
    assert torch.equal(padding_mask(four_d, 4), mask.bool())
    additive = torch.where(four_d, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(padding_mask(additive, 4), mask.bool())
    assert padding_mask(None) is None
    # no padding: nothing for the gates to mask (on CPU, outside compiled graphs)
    assert padding_mask(torch.ones(2, 4, dtype=torch.long)) is None
    assert padding_mask(causal[None, None].expand(2, 1, 4, 4), 4) is None
    # a StaticCache's 4D mask is wider than what it has filled; without a host-side length (on a device, or inside
    # a compiled graph) the whole row comes back, False after the last new position
    wide = torch.nn.functional.pad(four_d, (0, 3))
    assert torch.equal(padding_mask(wide), torch.nn.functional.pad(mask.bool(), (0, 3)))
    assert torch.equal(padding_mask(wide, torch.tensor(4)), mask.bool())  # a CPU tensor is read: free on the host
    # a mask of other dimensions is refused (read as no mask, the gates would count its padding as tokens)
    for other in (mask[0], mask[None], four_d[..., None]):
        with pytest.raises(ValueError, match=f"shape {tuple(other.shape)}".replace("(", "\\(").replace(")", "\\)")):
            padding_mask(other)


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


def test_daubechies_taps_keep_pywavelets_precision_in_every_dtype():
    energy = DaubechiesEnergy(2, "db4", [1, 2])
    exact = daubechies_kernels("db4", [1, 2])
    assert exact.dtype == torch.float64 and energy.taps.dtype == torch.float32
    assert torch.equal(energy.double().taps, exact)  # derived again, not float32-rounded then widened
    assert torch.equal(energy.to(torch.bfloat16).taps, exact.to(torch.bfloat16))
    assert not energy.taps.is_inference() and "taps" not in energy.state_dict()
    with torch.inference_mode():  # a move that changes nothing keeps the buffer (no inference tensor made)
        energy.to("cpu")
    assert not energy.taps.is_inference()
    energy.to_empty(device="cpu")  # new, uninitialised storage: the taps are derived again
    assert torch.equal(energy.taps, exact.to(torch.bfloat16))


def test_default_scales_per_energy_kind_and_both_configs_use_them():
    from hf_spectral import EGAConfig
    from hf_spectral.retrofit import EnergyGateConfig

    assert default_scales("conv") == default_scales("morlet") == [3, 7, 15, 31]  # kernel lengths (SPEC 1.3)
    assert default_scales("db2") == default_scales("db4") == [1, 2, 4, 8]  # dyadic dilations
    assert default_scales("linear") is None and default_scales("nonsense") is None
    for kind in ("linear", "conv", "morlet", "db2", "db4"):
        assert EGAConfig(energy_kind=kind).energy_scales == default_scales(kind)
        assert EnergyGateConfig(energy_kind=kind).scales == default_scales(kind)


def test_ega1_has_260_parameters_per_head_at_c256():
    gate = EnergyGate(256, 8, kind="linear", projections=1)
    assert sum(p.numel() for p in gate.parameters()) == 260 * 8


@pytest.mark.parametrize("normalization", ["causal", "window", "none"])
@pytest.mark.parametrize("kind", ["linear", "conv", "morlet", "db2", "db4"])
def test_gate_is_causal_and_incremental_for_every_energy(kind, normalization):
    """Gates and cached state computed step by step (with left padding) equal the full-sequence computation."""
    torch.manual_seed(4)
    gate = EnergyGate(16, 2, kind=kind, projections=2, scales=None if kind == "linear" else [3, 5], alpha_init=1.5,
                      normalization=normalization)
    x = torch.randn(2, 12, 16)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    bias, values, state, features = gate(x, valid, return_state=True)
    assert (state is None) == (normalization == "none") and (features is None) == (kind == "linear")
    assert state is None or state.dtype == torch.float32
    cached, pieces = [None, None], []
    for t in range(12):
        seen = valid[:, : t + 1] if cached != [None, None] else valid[:, t : t + 1]  # nothing kept: the new key
        step_bias, _, *step = gate(x[:, t : t + 1], seen, *cached, return_state=True)
        cached = [new if old is None else torch.cat([old, new], dim=2) for old, new in zip(cached, step)]
        pieces.append(step_bias[..., -1:])
    for kept, full in zip(cached, (state, features)):
        if full is not None:
            torch.testing.assert_close(kept, full, atol=1e-5, rtol=1e-5)
    if normalization == "window":  # each step re-normalises every key over the grown window: the last sees all
        torch.testing.assert_close(step_bias * valid[:, None], bias * valid[:, None], atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(torch.cat(pieces, -1) * valid[:, None], bias * valid[:, None], atol=1e-5, rtol=1e-5)
    # Changing the future leaves past gates untouched.
    changed = x.clone()
    changed[:, 7:] = torch.randn(2, 5, 16)
    torch.testing.assert_close(gate(changed, valid)[0][..., :7], bias[..., :7], atol=0, rtol=0)


def test_a_bfloat16_gate_keeps_float32_statistics_through_its_cache():
    """1,024 bfloat16 tokens fed one at a time: the running moments are kept in float32, so the gates stay within
    0.02 of a float32 gate on the same inputs."""
    torch.manual_seed(5)
    gate = EnergyGate(32, 4, kind="linear", projections=2, alpha_init=2.0)
    x = torch.randn(1, 1024, 32) + 1.0
    with torch.no_grad():
        _, reference, _, _ = gate(x)
        low = gate.to(torch.bfloat16)
        x_low = x.to(torch.bfloat16)
        state, values = None, []
        for t in range(1024):
            _, step_gate, step_state, _ = low(x_low[:, t : t + 1], past_state=state, return_state=True)
            assert step_state.dtype == torch.float32
            state = step_state if state is None else torch.cat([state, step_state], dim=2)
            values.append(step_gate)
    assert (torch.cat(values, -1) - reference).abs().max() < 0.02


def test_daubechies_energies_name_the_extra_when_pywavelets_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pywt", None)
    with pytest.raises(ImportError, match=r'pip install "hf_spectral\[wavelets\]"'):
        EnergyGate(16, 2, kind="db2", scales=[1, 2])


@pytest.mark.parametrize("mode", ["causal", "window"])
def test_gradients_stay_finite_where_the_std_is_zero(mode):
    # One-token prefixes and constant energies have zero variance; the eps floor must not produce NaN gradients.
    energy = torch.cat([torch.full((1, 1, 1, 4), 2.0), torch.randn(1, 1, 1, 4)], -1).requires_grad_()
    valid = torch.tensor([[False, True, True, True, True, True, True, True]])
    normalize_energy(energy, valid, mode).sum().backward()
    assert torch.isfinite(energy.grad).all()
