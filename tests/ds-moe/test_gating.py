"""Gating against a plain, loop-by-loop reference: capacity, dropping, RTS, top-1/top-2/top-k, aux loss, counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds_moe import TopKGate, top1gating, top2gating, topkgating
from ds_moe._gating import top1_routing, top2_routing, topk_routing
from ds_moe._routing import capacity

# ---------------------------------------------------------------- reference


def _ref_capacity(s: int, e: int, factor: float, min_cap: int) -> int:
    return max(math.ceil(s / e * factor - 1e-6), min_cap)  # the test values keep clear of fp32 rounding


def _place(choices, keep, num_experts):
    """Slot of each (token, choice) kept, in order: all first choices (token order), then second choices."""
    fill = [0] * num_experts
    loc = {}
    for j, col in enumerate(choices):
        for s, e in enumerate(col):
            if keep[j][s]:
                loc[(j, s)] = fill[e]
                fill[e] += 1
    return loc


def ref_top1(logits, cf, min_cap, drop_tokens=True, scores=None, used=None, choose_from=None):
    s_, e_ = logits.shape
    gates = torch.softmax(logits, dim=1)
    pick = (choose_from if choose_from is not None else gates).argmax(dim=1).tolist()
    routed = [used is None or bool(used[s]) for s in range(s_)]
    counts = [sum(1 for s in range(s_) if routed[s] and pick[s] == e) for e in range(e_)]
    cap = _ref_capacity(s_, e_, cf, min_cap) if drop_tokens else min(max(counts), s_)
    keep = [False] * s_
    for e in range(e_):
        mine = [s for s in range(s_) if routed[s] and pick[s] == e]
        if scores is not None:
            mine = sorted(sorted(mine, key=lambda s: -float(scores[s, e]))[:cap])
        keep_e = mine[:cap]
        for s in keep_e:
            keep[s] = True
    loc = _place([pick], [keep], e_)
    l_aux = sum(float(gates[:, e].mean()) * counts[e] / s_ for e in range(e_)) * e_
    weights = [float(gates[s, pick[s]]) if keep[s] else 0.0 for s in range(s_)]
    return dict(cap=cap, experts=[pick], kept=[keep], loc=loc, weights=[weights], counts=counts, l_aux=l_aux)


def ref_top2(logits, cf, min_cap, drop_tokens=True, noise=None):
    s_, e_ = logits.shape
    gates = torch.softmax(logits, dim=1)
    first = gates.argmax(dim=1).tolist()
    noisy = logits + noise if noise is not None else logits
    second = [max((e for e in range(e_) if e != first[s]), key=lambda e: float(noisy[s, e])) for s in range(s_)]
    counts1 = [first.count(e) for e in range(e_)]
    counts = [counts1[e] + second.count(e) for e in range(e_)]
    cap = _ref_capacity(s_, e_, 2 * cf, min_cap) if drop_tokens else max(counts)
    all_kept = [[True] * s_, [True] * s_]
    loc = _place([first, second], all_kept, e_)
    keep = [[loc[(j, s)] < cap for s in range(s_)] for j in range(2)]
    g = [[float(gates[s, c[s]]) if keep[j][s] else 0.0 for s in range(s_)] for j, c in enumerate([first, second])]
    denom = [max(g[0][s] + g[1][s], torch.finfo(torch.float32).eps) for s in range(s_)]
    weights = [[g[j][s] / denom[s] for s in range(s_)] for j in range(2)]
    l_aux = sum(float(gates[:, e].mean()) * counts1[e] / s_ for e in range(e_)) * e_
    loc = {key: v for key, v in loc.items() if keep[key[0]][key[1]]}
    return dict(cap=cap, experts=[first, second], kept=keep, loc=loc, weights=weights, counts=counts, l_aux=l_aux)


def ref_topk(logits, k, cf, min_cap, drop_tokens=True, policy="probs"):
    s_, e_ = logits.shape
    gates = torch.softmax(logits, dim=1)
    picks = [sorted(range(e_), key=lambda e: -float(gates[s, e]))[:k] for s in range(s_)]
    counts = [sum(e in p for p in picks) for e in range(e_)]
    cap = _ref_capacity(s_, e_, k * cf, min_cap) if drop_tokens else max(counts)
    kept_pairs = set()
    for e in range(e_):
        mine = [s for s in range(s_) if e in picks[s]]
        if policy == "probs":
            mine = sorted(mine, key=lambda s: -float(gates[s, e]))
        kept_pairs.update((s, e) for s in mine[:cap])
    loc = {}
    for e in range(e_):
        for i, s in enumerate(sorted(s for (s, x) in kept_pairs if x == e)):
            loc[(s, e)] = i
    l_aux = sum(float(gates[:, e].mean()) * counts[e] / s_ for e in range(e_)) * e_ / k
    return dict(cap=cap, picks=picks, kept=kept_pairs, loc=loc, counts=counts, l_aux=l_aux, gates=gates)


def _check(routing, ref):
    assert routing.capacity == ref["cap"]
    assert routing.exp_counts.tolist() == ref["counts"] and routing.exp_counts.dtype == torch.int64
    assert routing.l_aux.item() == pytest.approx(ref["l_aux"], rel=1e-5)
    assert routing.experts.tolist() == ref["experts"]
    assert routing.kept.tolist() == ref["kept"]
    for j, row in enumerate(routing.kept.tolist()):
        for s, kept in enumerate(row):
            if kept:
                assert routing.locations[j, s].item() == ref["loc"][(j, s)], (j, s)
    torch.testing.assert_close(routing.weights, torch.tensor(ref["weights"]), rtol=1e-5, atol=1e-6)


def _dense_ref(routing):
    """[S, E, C] combine weights built by loops from a routing."""
    k, s_ = routing.experts.shape
    out = torch.zeros(s_, routing.num_experts, routing.capacity)
    for j in range(k):
        for s in range(s_):
            if routing.kept[j, s]:
                out[s, routing.experts[j, s], routing.locations[j, s]] += routing.weights[j, s]
    return out


CASES = [(16, 4, 1.0, 4, 3.0), (32, 4, 1.0, 2, 4.0), (24, 3, 2.0, 1, 1.0), (10, 5, 1.0, 8, 0.5), (40, 8, 0.5, 1, 3.0)]

# ------------------------------------------------------------------ tests


def test_capacity_formula_and_min_capacity_floor():
    assert capacity(16, 4, 1.0, 4) == 4 and capacity(16, 4, 1.0, 8) == 8
    assert capacity(10, 4, 1.0, 0) == 3 and capacity(10, 4, 2.0, 0) == 5
    assert capacity(100, 10, 1.1, 0) == 11  # DeepSpeed multiplies in fp32: 10 * 1.1f rounds to 11.0


@pytest.mark.parametrize(("s", "e", "cf", "min_cap", "scale"), CASES)
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_top1_matches_reference_without_rts(s, e, cf, min_cap, scale, drop_tokens):
    logits = torch.randn(s, e, generator=torch.Generator().manual_seed(s * e)) * scale
    routing = top1_routing(logits, cf, min_cap, drop_tokens=drop_tokens, use_rts=False)
    _check(routing, ref_top1(logits, cf, min_cap, drop_tokens))
    l_aux, combine, mask, counts = top1gating(logits, cf, min_cap, drop_tokens=drop_tokens, use_rts=False)
    torch.testing.assert_close(combine, _dense_ref(routing))
    assert torch.equal(mask, combine.bool()) and torch.equal(counts, routing.exp_counts)


def test_top1_drops_over_capacity_keeping_the_earliest_tokens():
    logits = torch.zeros(12, 3)
    logits[:, 1] = 5.0  # every token prefers expert 1; capacity = max(ceil(12 / 3), 2) = 4
    routing = top1_routing(logits, 1.0, 2, use_rts=False)
    assert routing.capacity == 4 and routing.exp_counts.tolist() == [0, 12, 0]
    assert routing.kept[0].tolist() == [True] * 4 + [False] * 8
    assert routing.locations[0, :4].tolist() == [0, 1, 2, 3]
    assert (routing.weights[0, 4:] == 0).all()
    assert top1_routing(logits, 1.0, 2, drop_tokens=False, use_rts=False).kept.all()


@pytest.mark.parametrize(("s", "e", "cf", "min_cap", "scale"), CASES)
def test_top1_random_token_selection_matches_reference_and_is_seeded(s, e, cf, min_cap, scale):
    logits = torch.randn(s, e, generator=torch.Generator().manual_seed(7)) * scale
    torch.manual_seed(1234)
    scores = torch.rand(s, e)  # the uniform draw RTS makes, [S, E], first draw of the call
    torch.manual_seed(1234)
    routing = top1_routing(logits, cf, min_cap, use_rts=True)
    _check(routing, ref_top1(logits, cf, min_cap, scores=scores))
    torch.manual_seed(1234)
    again = top1_routing(logits, cf, min_cap, use_rts=True)
    assert torch.equal(again.kept, routing.kept) and torch.equal(again.locations, routing.locations)


def test_rts_keeps_a_random_subset_not_the_first_tokens():
    logits = torch.zeros(64, 2)
    logits[:, 0] = 5.0
    kept = [top1_routing(logits, 1.0, 1, use_rts=True).kept[0] for _ in range(2)]
    assert all(k.sum().item() == 32 for k in kept)
    assert not torch.equal(kept[0], kept[1]) and not kept[0][:32].all()


def test_top1_used_token_masks_tokens_out_of_routing_counts_and_loss():
    logits = torch.randn(12, 3, generator=torch.Generator().manual_seed(3))
    used = torch.tensor([1, 0] * 6)
    routing = top1_routing(logits, 1.0, 1, used_token=used, use_rts=False)
    _check(routing, ref_top1(logits, 1.0, 1, used=used))
    assert not routing.kept[0, 1::2].any() and routing.exp_counts.sum().item() == 6


def test_top1_needs_at_least_min_capacity_tokens():
    with pytest.raises(ValueError, match=r"No. of tokens \(3\).*min_capacity \(4\)"):
        top1_routing(torch.randn(3, 2), 1.0, 4)


@pytest.mark.parametrize(("s", "e", "cf", "min_cap", "scale"), CASES)
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_top2_matches_reference(s, e, cf, min_cap, scale, drop_tokens):
    logits = torch.randn(s, e, generator=torch.Generator().manual_seed(s + e)) * scale
    routing = top2_routing(logits, cf, min_cap, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False)
    _check(routing, ref_top2(logits, cf, min_cap, drop_tokens))
    l_aux, combine, mask, counts = top2gating(logits, cf, min_cap, drop_tokens, None, False)
    torch.testing.assert_close(combine, _dense_ref(routing))
    assert (combine.sum(dim=(1, 2)) <= 1 + 1e-6).all()


def test_top2_second_expert_is_gumbel_sampled_from_the_seed():
    logits = torch.randn(20, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(99)
    noise = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((20, 5))
    torch.manual_seed(99)
    routing = top2_routing(logits, 1.0, 4)
    _check(routing, ref_top2(logits, 1.0, 4, noise=noise))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize(("k", "drop_tokens"), [(2, True), (3, True), (3, False)])
def test_topk_matches_reference(k, drop_tokens, policy):
    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(k)) * 3
    routing = topk_routing(logits, k, 0.5, 1, drop_tokens=drop_tokens, drop_policy=policy)
    ref = ref_topk(logits, k, 0.5, 1, drop_tokens, policy)
    assert routing.capacity == ref["cap"] and routing.exp_counts.tolist() == ref["counts"]
    assert routing.l_aux.item() == pytest.approx(ref["l_aux"], rel=1e-5)
    assert routing.experts.t().tolist() == ref["picks"]
    for j in range(k):
        for s in range(24):
            e = ref["picks"][s][j]
            assert bool(routing.kept[j, s]) == ((s, e) in ref["kept"])
            if (s, e) in ref["kept"]:
                assert routing.locations[j, s].item() == ref["loc"][(s, e)]
                total = sum(float(ref["gates"][s, x]) for x in ref["picks"][s] if (s, x) in ref["kept"])
                assert routing.weights[j, s].item() == pytest.approx(float(ref["gates"][s, e]) / total, rel=1e-5)
    torch.testing.assert_close(topkgating(logits, k, 0.5, 1, drop_tokens, None, policy)[1], _dense_ref(routing))
    with pytest.raises(ValueError, match="drop_policy: 'nearest'"):
        topk_routing(logits, k, 1.0, 1, drop_policy="nearest")


def test_aux_loss_is_deepspeeds_me_ce_times_experts_and_has_a_gradient():
    logits = torch.randn(16, 4, requires_grad=True)
    l_aux = top1gating(logits, 1.0, 4, use_rts=False)[0]
    gates = F.softmax(logits, dim=1)
    ce = F.one_hot(gates.argmax(1), 4).float().mean(0)
    torch.testing.assert_close(l_aux, (gates.mean(0) * ce).sum() * 4)
    l_aux.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# --------------------------------------------------------------- TopKGate


def _gate(**kw):
    torch.manual_seed(0)
    return TopKGate(6, 4, min_capacity=1, **kw)


def test_gate_bad_k_and_policy_are_value_errors():
    with pytest.raises(ValueError, match="k=5"):
        TopKGate(6, 4, k=5)
    with pytest.raises(ValueError, match="k=0"):
        TopKGate(6, 4, k=0)
    with pytest.raises(ValueError, match=r"'Gaussian'.*'Jitter', 'RSample'"):
        TopKGate(6, 4, noisy_gate_policy="Gaussian")


def test_gate_has_an_fp32_bias_free_router_and_uses_eval_capacity_in_eval():
    gate = _gate(capacity_factor=1.0, eval_capacity_factor=2.0, use_rts=False)
    assert gate.wg.bias is None and tuple(gate.wg.weight.shape) == (4, 6)
    x = torch.randn(16, 6)
    assert gate.route(x).capacity == 4
    gate.eval()
    assert gate.route(x).capacity == 8
    out = gate(x)
    assert len(out) == 4 and out[1].shape == (16, 4, 8)


def test_gate_jitter_multiplies_the_input_in_training_only():
    gate = _gate(noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(16, 6) * 3
    torch.manual_seed(5)
    u = torch.distributions.Uniform(torch.tensor(0.99), torch.tensor(1.01)).rsample(x.shape)
    torch.manual_seed(5)
    got = gate.route(x)
    want = top1_routing(F.linear(x * u, gate.wg.weight), 1.0, 1, use_rts=False)
    torch.testing.assert_close(got.l_aux, want.l_aux)
    torch.testing.assert_close(got.weights, want.weights)
    gate.eval()
    torch.testing.assert_close(gate.route(x).weights, top1_routing(F.linear(x, gate.wg.weight), 1.0, 1,
                                                                   use_rts=False).weights)


def test_gate_rsample_picks_by_gumbel_noised_logits_but_weights_by_clean_gates():
    gate = _gate(noisy_gate_policy="RSample", use_rts=False)
    x = torch.randn(16, 6)
    logits = F.linear(x, gate.wg.weight).detach()
    torch.manual_seed(11)
    noise = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((16, 4))
    torch.manual_seed(11)
    _check(gate.route(x), ref_top1(logits, 1.0, 1, choose_from=logits + noise))
