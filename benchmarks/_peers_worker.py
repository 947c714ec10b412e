"""One measurement of ``benchmarks/peers.py``, run by whichever Python holds the framework under test.

``python _peers_worker.py '<job json>'`` starts ``world`` gloo ranks (1 torch thread each), builds the job's model
from seed 0, trains it under the job's framework and prints one line ``PEERS_RESULT <json>``. Frameworks:
``deepspeed`` (whichever ``deepspeed`` this interpreter imports: this project in the bench env, the real one in its
side venv), ``ddp`` (torch DistributedDataParallel) and ``fsdp2`` (torch ``fully_shard``), the torch peers with
``torch.optim.AdamW(fused=True)``, and ``hf`` (plain Hugging Face ``generate``, for ``infer`` jobs). A job's
``kind`` (default ``train``) may instead be ``pipe``, ``moe`` or ``infer``: a model of its own, built through
DeepSpeed's public API only (``deepspeed.pipe``, ``deepspeed.moe.layer.MoE``, ``deepspeed.init_inference``). Needs
only torch (and deepspeed for that framework): it also runs in the real DeepSpeed's venv, so from this repository it
imports only ``benchmarks/_common.py`` (torch and stdlib).

Measured: each timed step on the slowest rank (ms; a barrier starts every step), the peak RSS of each rank
(``ru_maxrss``, MiB, imports included: every framework pays its own), the first-step latency (launch of the
interpreter to the end of the first step: import + initialize + first step, slowest rank, s), and for
``ckpt`` jobs the save and load times (slowest rank), bytes on disk and DeepSpeed's ``zero_to_fp32`` time on
the same checkpoint (rank 0).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import traceback

LAUNCHED = float(os.environ.get("PEERS_LAUNCHED", time.time()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the infer job builds its GPT-2 from a config: nothing to download

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import timed_ms  # noqa: E402  (the script's folder is on sys.path)
from torch import nn  # noqa: E402

OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


class MLP(nn.Module):
    def __init__(self, width: int = 1024, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x, y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: ``layers`` pre-LN blocks of width ``d``; forward(ids) -> next-token cross-entropy."""

    def __init__(self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, seq: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build(job: dict) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    if job["model"] == "mlp":
        model = MLP()
        batch = (torch.randn(16, 1024, generator=gen), torch.randn(16, 1024, generator=gen))
    else:
        model = GPT()
        ids = torch.randint(0, 4096, (4, 256), generator=gen)
        batch = (ids, ids)
    return model, batch


def ds_config(job: dict, micro: int, scratch: str) -> dict:
    zero: dict = {"stage": job["stage"]}
    offload = job.get("offload")
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if job["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": scratch}
        zero["offload_param"] = {"device": "nvme", "nvme_path": scratch}
    optimizer = {"type": "AdamW", "params": {**OPTIM, "betas": list(OPTIM["betas"])}}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": zero, "optimizer": optimizer}


PIPE = {"width": 1024, "layers": 8, "micro": 4, "micro_batches": 8}
MOE = {"width": 512, "experts": 4, "ep_size": 2, "tokens": 256}
INFER = {"batch": 4, "prompt": 32, "new_tokens": 32}


def pipe_step(job: dict):
    """2-stage pipeline of Linear+GELU layers, 8 micro-batches per ``train_batch`` (DeepSpeed's PipelineModule)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    width, micro, gas = PIPE["width"], PIPE["micro"], PIPE["micro_batches"]
    specs = [spec for _ in range(PIPE["layers"]) for spec in (LayerSpec(nn.Linear, width, width), LayerSpec(nn.GELU))]
    model = PipelineModule(layers=specs, num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    gen = torch.Generator().manual_seed(1000)
    data = [(torch.randn(micro, width, generator=gen), torch.randn(micro, width, generator=gen)) for _ in range(gas)]
    config = {**ds_config({"stage": 0}, micro, ""), "gradient_accumulation_steps": gas}
    engine, _, _, _ = deepspeed_initialize(model, config)

    def step() -> None:
        loss = engine.train_batch(iter(data))
        step.loss = float("-inf") if loss is None else float(loss)  # the last stage's; others may return None
    return step, engine


class MoEModel(nn.Module):
    """Linear in, DeepSpeed's MoE layer (top-1 gate over ``experts`` FFN experts, ``ep_size`` ranks), Linear out."""

    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        width = MOE["width"]
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        expert = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.moe = MoE(hidden_size=width, expert=expert, num_experts=MOE["experts"], ep_size=MOE["ep_size"], k=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, aux, _ = self.moe(self.inp(x))
        return nn.functional.mse_loss(self.out(hidden), y) + 0.01 * aux


def moe_step(job: dict):
    torch.manual_seed(0)
    model = MoEModel()
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    batch = (torch.randn(1, MOE["tokens"], MOE["width"], generator=gen),
             torch.randn(1, MOE["tokens"], MOE["width"], generator=gen))
    engine, _, _, _ = deepspeed_initialize(model, ds_config({"stage": 0}, 1, ""))

    def step() -> None:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        step.loss = float(loss)
    return step, engine


def infer_step(job: dict):
    """Greedy ``generate`` of a tiny random-weight GPT-2 (no hub download): plain Hugging Face or through
    ``deepspeed.init_inference``; the result's ``tokens_per_s`` counts the new tokens of the whole batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=4096, n_positions=256, n_embd=256, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(config).eval()
    if job["framework"] == "deepspeed":
        import deepspeed

        model = deepspeed.init_inference(model, dtype=torch.float32)
    elif job["framework"] != "hf":
        raise ValueError(f"framework {job['framework']!r} for an infer job: accepted deepspeed, hf")
    gen = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, 4096, (INFER["batch"], INFER["prompt"]), generator=gen)
    new = INFER["new_tokens"]
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new, "min_new_tokens": new,
              "do_sample": False, "pad_token_id": 0}

    def step() -> None:
        with torch.no_grad():
            out = model.generate(input_ids=ids, **kwargs)
        if out.shape[1] != INFER["prompt"] + new:
            raise RuntimeError(f"generate returned {out.shape[1]} positions, expected {INFER['prompt'] + new}")
        step.tokens = out[:, INFER["prompt"]:].tolist()  # greedy: every framework should produce the same
    return step, None


def deepspeed_initialize(model: nn.Module, config: dict):
    import deepspeed

    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def make_step(job: dict, scratch: str):
    """(step function, engine or None) for the job's framework."""
    kind = job.get("kind", "train")
    if kind != "train":
        return {"pipe": pipe_step, "moe": moe_step, "infer": infer_step}[kind](job)
    model, batch = build(job)
    framework = job["framework"]
    if framework == "deepspeed":
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(job, batch[0].shape[0], scratch))

        def step() -> None:
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
        return step, engine
    if framework == "ddp":
        module = nn.parallel.DistributedDataParallel(model)
    elif framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        module = fully_shard(model)
    else:
        raise ValueError(f"framework {framework!r}: accepted deepspeed, ddp, fsdp2")
    optimizer = torch.optim.AdamW(module.parameters(), **OPTIM, fused=True)

    def step() -> None:
        module(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return step, None


def _cpu_s() -> float:
    """User + system CPU seconds of this rank's process, every thread (gloo's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def checkpoint_times(engine, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(ckpt, tag="t")
    save = slowest(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(ckpt, tag="t")
    load = slowest(time.perf_counter() - start)
    out = {"save_s": save, "load_s": load, "bytes": dir_bytes(ckpt) if dist.get_rank() == 0 else 0}
    dist.barrier()
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        start = time.perf_counter()
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
        out["z2f_s"] = time.perf_counter() - start
        out["z2f_params"] = int(sum(v.numel() for v in state.values()))
    dist.barrier()
    return out


def rank_main(rank: int, job: dict, port: int, queue) -> None:
    world = job["world"]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if job["framework"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    scratch = tempfile.mkdtemp(prefix="peers_") if rank == 0 else ""
    holder = [scratch]
    dist.broadcast_object_list(holder)
    scratch = holder[0]
    try:
        nvme = os.path.join(scratch, "nvme")
        os.makedirs(nvme, exist_ok=True)  # this project refuses an nvme_path that does not exist (deviations.md)
        step, engine = make_step(job, nvme)
        step()
        first = slowest(time.time() - LAUNCHED)
        for _ in range(job["warmup"]):
            step()
        cpu_before = _cpu_s()
        result = {"step_ms": timed_ms(step, job["steps"]), "first_step_s": first}
        cpu = torch.tensor([(_cpu_s() - cpu_before) * 1000.0 / job["steps"]], dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.MAX)  # the busier rank's CPU time: little moved by other jobs' load
        result["cpu_ms"] = float(cpu)
        if job.get("kind") == "infer":
            per_s = [INFER["batch"] * INFER["new_tokens"] * 1000.0 / ms for ms in result["step_ms"]]
            result["tokens_per_s"] = sorted(per_s)[len(per_s) // 2]
            result["generated"] = step.tokens
        if job.get("kind") in ("pipe", "moe"):  # same worker code, same seeds: the frameworks' numerics side by side
            last = torch.tensor([step.loss], dtype=torch.float64)
            dist.all_reduce(last, op=dist.ReduceOp.MAX)
            result["last_loss"] = float(last)
        if job.get("ckpt"):
            result.update(checkpoint_times(engine, scratch))
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        result["peak_rss_mib"] = float(rss)
        if rank == 0:
            queue.put(result)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()


def main() -> None:
    job = json.loads(sys.argv[1])
    queue = mp.get_context("spawn").SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank_main, args=(job, port, queue), nprocs=job["world"], join=True, start_method="spawn")
        result = queue.get()
    except Exception as exc:  # the row reports the framework's own error
        text = str(exc).strip().splitlines()
        last = [line for line in text if "Error" in line or "error" in line] or text or [repr(exc)]
        result = {"error": last[-1][:300]}
        traceback.print_exc()
    result["torch"] = torch.__version__
    try:
        import deepspeed

        result["deepspeed"] = getattr(deepspeed, "__version__", "?")
    except Exception:  # noqa: BLE001 (the torch peers run without it)
        result["deepspeed"] = None
    print("PEERS_RESULT " + json.dumps(result, allow_nan=True), flush=True)


if __name__ == "__main__":
    main()
