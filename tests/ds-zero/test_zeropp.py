"""ZeRO++ through ``deepspeed.initialize`` on gloo ranks.

- hpZ (4 ranks, ``zero_hpz_partition_size`` 2): backward gathers come from the secondary partition inside pairs
  of ranks, and training equals plain ZeRO-3 (fp32, 1e-6 relative; measured: identical); a
  ``GatheredParameters(modifier_rank=0)`` modification reaches the secondary partition too;
- qwZ / qgZ (2 ranks, 50 steps of a tiny GPT-2-like model): the loss curve stays within ``LOSS_TOL`` relative
  of the unquantized one at every step (measured: 4e-3 qwZ, 3e-3 qgZ, 1e-2 both with LoCo) and the quantized
  collectives send at most 0.3x the bytes of the unquantized ones (measured: 0.26x), counted where the
  collectives are issued (``ds_zero.zeropp.traffic``);
- the qgZ two-hop quantized all-to-all (4 ranks as 2 nodes x 2) sums every rank's rows within the int8 bound;
- ``zero_quantized_nontrainable_weights``: frozen partitions are stored int8, train within ``LOSS_TOL`` of the
  unquantized run, gather fewer bytes, and survive a checkpoint round trip.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _sibling import load_sibling

common = load_sibling(__file__, "_zeropp_common.py", "_ds_zero_zeropp_common")

LOSS_TOL = 2e-2  # relative, per step, quantized against unquantized
BYTES_RATIO = 0.3
QUANT_STEPS = 50
FROZEN_STEPS = 10
LOCO = {"err_beta": 0.8, "reset_T": 1024}


def _two_hop_reduce() -> dict:
    from ds_zero.zeropp.groups import across_group, block_group
    from ds_zero.zeropp.qgz import QuantizedReduce

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn(world, 300, generator=gen)
    reducer = QuantizedReduce(block_group(None, 2), across_group(None, 2), dist, 64)
    got = reducer.reduce(rows.clone())
    every = [torch.randn(world, 300, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    exact = sum(t[rank] for t in every)
    return {"err": float((got - exact).abs().max()), "scale": float(max(t.abs().max() for t in every))}


def _init_quantized_weights() -> dict:
    import deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init(zero_quantized_weights=True):
        layer = torch.nn.Linear(64, 64)
    torch.manual_seed(0)
    exact = torch.nn.Linear(64, 64).weight.detach()
    with deepspeed.zero.GatheredParameters([layer.weight]):
        err = float((layer.weight.detach() - exact).abs().max())
    return {"err": err, "bound": float(exact.abs().max()) / 254, "quantize": layer.weight.ds_space.quantize}


def _hpz_after_modifier() -> float:
    """``GatheredParameters(modifier_rank=0)`` under hpZ: the secondary partition (what backward gathers read)
    holds the modified values; returns its largest difference from them."""
    import deepspeed

    cfg = common.config({"stage3_max_reuse_distance": 0, "zero_hpz_partition_size": 2})
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=common.TinyGPT(), config=cfg)
    engine.backward(engine(common.batches(1, common.MICRO)[0]))
    engine.step()
    w = engine.module.fc.weight
    with deepspeed.zero.GatheredParameters([w]):
        new = w.detach().reshape(-1) * 2
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0), torch.no_grad():
        w.mul_(2)
    part = w.ds_secondary.numel()
    start = w.ds_space.secondary.rank * part
    return float((w.ds_secondary - new[start:start + part]).abs().max())


def _hpz_body() -> dict:
    cfg = common.config
    reuse = {"stage3_max_reuse_distance": 0}  # released after use: backward gathers again
    out = {"plain": common.train(cfg(reuse), 6), "hpz": common.train(cfg({**reuse, "zero_hpz_partition_size": 2}), 6)}
    out["two_hop"] = _two_hop_reduce()
    out["init_qwz"] = _init_quantized_weights()
    out["modified"] = _hpz_after_modifier()
    try:
        common.train(cfg({"zero_hpz_partition_size": 3}), 1)
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


def test_hpz_equals_plain_stage3():
    results = run_distributed(_hpz_body, world_size=4, timeout=180)
    r = results[0]
    got, plain = r["hpz"], r["plain"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got["losses"], plain["losses"], strict=True))
    assert common.rel(got["state"], plain["state"]) <= 1e-6
    assert all(common.rel(x["hpz"]["state"], got["state"]) == 0 for x in results)
    # backward gathered from the secondary partitions (1 peer, half the value) instead of the 3 primary peers
    assert got["bytes"]["param_gather_secondary"] > 0
    assert got["bytes"]["param_gather"] + got["bytes"]["param_gather_secondary"] < plain["bytes"]["param_gather"]
    # two hops of int8 (each within max|x| / 254 per summand): 4 summands, 2 quantizations each
    for x in results:
        assert 0 < x["two_hop"]["err"] <= 4 * 2 * x["two_hop"]["scale"] / 254 * 1.5
    assert "zero_hpz_partition_size=3" in r["bad"]
    assert all(x["modified"] == 0 for x in results)  # GatheredParameters' modification reached the hpZ partition
    assert got["space"] == {"world": 4, "secondary": 2, "hierarchy": None}
    # zero.Init(zero_quantized_weights=True): gathers dequantize int8 values, within half a step of the weights
    init = r["init_qwz"]
    assert init["quantize"] and 0 < init["err"] <= init["bound"] * 1.001


FROZEN = ("wpe.weight", "fc.weight", "fc.bias")


def _quant_body(folder: str) -> dict:
    cfg = common.config
    frozen_q = cfg({"zero_quantized_nontrainable_weights": True})
    return {
        "frozen": common.train(cfg({}), FROZEN_STEPS, freeze=FROZEN),
        "frozen_q": common.train(frozen_q, FROZEN_STEPS, freeze=FROZEN, save=folder),
        "frozen_q_loaded": common.train(frozen_q, 0, freeze=FROZEN, load=folder),
        "plain": common.train(cfg({}), QUANT_STEPS),
        "qwz": common.train(cfg({"zero_quantized_weights": True}), QUANT_STEPS),
        "qgz": common.train(cfg({"zero_quantized_gradients": True}), QUANT_STEPS),
        "both_loco": common.train(cfg({"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                       "zeropp_loco_param": LOCO}), QUANT_STEPS),
    }


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("frozen_q"))
    return run_distributed(_quant_body, world_size=2, args=(folder,), timeout=240)[0]


@pytest.mark.parametrize("variant", ["qwz", "qgz", "both_loco"])
def test_quantized_loss_curve_close_to_unquantized(quantized, variant):
    plain, got = quantized["plain"]["losses"], quantized[variant]["losses"]
    assert plain[-1] < 0.8 * plain[0]  # it learns
    worst = max(abs(a - b) / b for a, b in zip(got, plain, strict=True))
    assert worst <= LOSS_TOL
    assert got != plain  # the quantized path really ran


@pytest.mark.parametrize(("variant", "kind"), [("qwz", "param_gather"), ("qgz", "grad_reduce"),
                                               ("both_loco", "param_gather"), ("both_loco", "grad_reduce")])
def test_quantized_collectives_send_less(quantized, variant, kind):
    assert quantized["qwz"]["accessors"] == (1, True, False, False)  # the engine's DeepSpeed accessors
    assert quantized["both_loco"]["accessors"] == (1, True, True, False)
    assert quantized[variant]["bytes"][kind] <= BYTES_RATIO * quantized["plain"]["bytes"][kind]


def test_nontrainable_weights_stored_quantized(quantized):
    got, base = quantized["frozen_q"], quantized["frozen"]
    assert got["frozen_dtypes"] == [torch.int8] * len(FROZEN) and base["frozen_dtypes"] == [torch.float32] * 3
    assert max(abs(a - b) / b for a, b in zip(got["losses"], base["losses"], strict=True)) <= LOSS_TOL
    assert got["losses"] != base["losses"]
    assert got["bytes"]["param_gather"] < base["bytes"]["param_gather"]  # the frozen weights travel as int8
    loaded = quantized["frozen_q_loaded"]  # the checkpoint holds their values; loading quantizes them again
    assert loaded["frozen_dtypes"] == [torch.int8] * len(FROZEN)
    assert common.rel(loaded["state"], got["state"]) <= 1e-6
