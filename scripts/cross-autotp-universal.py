"""Convert a real DeepSpeed AutoTP (tp=2) ZeRO-1 training checkpoint to a Universal Checkpoint with both
``ds_to_universal``s and compare every written tensor (bit for bit) and ``step``.

Usage (the project's python): ``bash scripts/hatch run test:python scripts/cross-autotp-universal.py [--keep DIR]``.
The real DeepSpeed trains (2 gloo ranks, a column-parallel ``up_proj``, a row-parallel ``down_proj``, a
replicated LayerNorm; 2 Adam steps) and saves; then the real converter and ours convert the same folder. The real
DeepSpeed's python comes from ``scripts/real-deepspeed-venv.sh``. Needs minutes (the real DeepSpeed's launch);
not part of the CI suite. ``--worker OUT`` is the real DeepSpeed's training half (run with its interpreter).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_and_save(rank: int, out: str, port: int) -> None:
    import torch

    import deepspeed

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj, self.down_proj = torch.nn.Linear(8, 10), torch.nn.Linear(10, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.down_proj(torch.relu(self.up_proj(x)))).sum()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    model = Model()
    specs = [{"patterns": [r".*up_proj\.weight$"], "partition_type": "column"},
             {"patterns": [r".*down_proj\.weight$"], "partition_type": "row"}]
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False,
                                                                         "layer_specs": specs}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(2):
        engine.backward(engine(torch.randn(1, 8, generator=torch.Generator().manual_seed(step))))
        engine.step()
    engine.save_checkpoint(out, tag="t")


def _compare(real: str, ours: str) -> list[tuple[str, str, bool]]:
    import torch

    rows = []
    for name in sorted(os.listdir(os.path.join(real, "zero"))):
        if name.endswith(".pt"):
            continue
        for file in sorted(os.listdir(os.path.join(real, "zero", name))):
            a, b = (torch.load(os.path.join(d, "zero", name, file), weights_only=False) for d in (real, ours))
            if isinstance(a, dict):
                a, b = a["param"], b["param"]
            rows.append((name, file, bool(torch.equal(a, b)) if torch.is_tensor(a) else a == b))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and keep it")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_train_and_save, args=(args.worker, port), nprocs=2)
        return 0
    real_python = subprocess.run(["bash", os.path.join(ROOT, "scripts", "real-deepspeed-venv.sh")], check=True,
                                 capture_output=True, text=True).stdout.strip()
    work = args.keep or tempfile.mkdtemp(prefix="cross-autotp-uc-")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    real_cwd = tempfile.gettempdir()  # not the repository: its packages must not shadow the real deepspeed
    subprocess.run([real_python, os.path.abspath(__file__), "--worker", os.path.join(work, "ckpt")], check=True,
                   env=env, cwd=real_cwd)
    tag = os.path.join(work, "ckpt", "t")
    subprocess.run([real_python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
                    "--output_folder", os.path.join(work, "real_uc"), "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, env=env, cwd=real_cwd, capture_output=True)
    from deepspeed.checkpoint.ds_to_universal import main as ours

    ours(["--input_folder", tag, "--output_folder", os.path.join(work, "ours_uc")])
    rows = _compare(os.path.join(work, "real_uc"), os.path.join(work, "ours_uc"))
    print("| parameter | file | ours == real |\n|---|---|---|")
    for name, file, same in rows:
        print(f"| {name} | {file} | {'yes' if same else 'NO'} |")
    print(f"{sum(same for *_, same in rows)} of {len(rows)} files equal; work folder {work}")
    return 0 if all(same for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
