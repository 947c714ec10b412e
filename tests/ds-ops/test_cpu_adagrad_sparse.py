"""DeepSpeedCPUAdagrad with sparse (COO) gradients: only the entries a gradient holds move, as in torch's Adagrad."""

from __future__ import annotations

import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad


def _sparse_rows(vocab: int, dim: int, rows: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor([rows])
    return torch.sparse_coo_tensor(index, torch.randn(len(rows), dim, generator=g), (vocab, dim))


def test_sparse_grads_match_torch_adagrad_and_leave_other_rows():
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(16, 4))
    ref = torch.nn.Parameter(ours.detach().clone())
    opt, ref_opt = DeepSpeedCPUAdagrad([ours], lr=0.1), torch.optim.Adagrad([ref], lr=0.1)
    untouched = ours.detach()[[0, 5]].clone()
    for step in range(6):
        rows = [1, 3, 3, 7] if step % 2 else [2, 3, 9]  # repeated rows are summed by coalesce
        ours.grad = _sparse_rows(16, 4, rows, step)
        ref.grad = _sparse_rows(16, 4, rows, step)
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.state[ours]["sum"], ref_opt.state[ref]["sum"], rtol=1e-6, atol=1e-6)
    assert torch.equal(ours.detach()[[0, 5]], untouched)
    assert ours.grad.is_sparse  # the caller's grad is left in place


def test_embedding_sparse_and_dense_params_in_one_step():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    lin = torch.nn.Linear(3, 1)
    ref_emb, ref_lin = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1)
    ref_emb.load_state_dict(emb.state_dict())
    ref_lin.load_state_dict(lin.state_dict())
    opt = DeepSpeedCPUAdagrad(list(emb.parameters()) + list(lin.parameters()), lr=0.05)
    ref_opt = torch.optim.Adagrad(list(ref_emb.parameters()) + list(ref_lin.parameters()), lr=0.05)
    tokens = torch.tensor([[1, 4, 4, 8]])
    for _ in range(3):
        for embed, head, o in ((emb, lin, opt), (ref_emb, ref_lin, ref_opt)):
            o.zero_grad()
            head(embed(tokens)).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(emb.weight, ref_emb.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.weight, ref_lin.weight, rtol=1e-5, atol=1e-6)
    assert opt.state[emb.weight]["step"] == 3
