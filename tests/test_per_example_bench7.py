"""The per-example bench's GPT-2 cell: TorchJD 0.18's autogram disagrees there, for reasons of
its own (a (1, T) position index shared by the batch, a tied head), and the bench's "agrees"
column says so; funcgrad agrees with the per-example loop on the same model and inputs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchjd")

from funcgrad.bench import __main__ as bench
from funcgrad.bench import _per_example


def test_gpt2_cell_names_torchjds_disagreement_and_funcgrad_agrees():
    case = _per_example.per_example_case(4, True, "gpt2")
    assert case.extra["agreement_detail"] == {"torchjd autogram": _per_example.TORCHJD_GPT2}
    wanted = ("naive", "torchjd autogram", "funcgrad per_example")
    results = {name: case.methods[name]() for name in wanted}
    case.reference_for = {}
    verdicts = bench._agreement(case, results)
    assert verdicts["funcgrad per_example"] == "ok"
    assert verdicts["torchjd autogram"].startswith("DISAGREES")


def test_torchjd_autogram_error_is_the_shared_index_and_the_tied_head():
    """The documented cause, exactly: with the position index expanded to (B, T) and the head
    untied, TorchJD's Gramian is the per-example loop's (so the bench feeds it a model it
    gets wrong, not a wrong model)."""
    from torchjd.autogram import Engine

    model, (tokens, _) = _per_example._model("gpt2", 4, True)
    model = model.double()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    criterion = torch.nn.CrossEntropyLoss(reduction="none")

    def losses(ids: torch.Tensor) -> torch.Tensor:
        logits = model(tokens, position_ids=ids).logits[:, :-1]
        return criterion(logits.transpose(1, 2), tokens[:, 1:]).sum(1)

    shared = torch.arange(tokens.shape[1])[None]
    params = list(model.parameters())
    each = losses(shared)
    rows = torch.stack(
        [
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
            for loss in each
        ]
    )
    exact = rows @ rows.T
    engine = Engine(model, batch_dim=0)
    with _per_example._torch_vmap_fallback_quiet():
        wrong = engine.compute_gramian(losses(shared))
        right = engine.compute_gramian(losses(shared.expand(len(tokens), -1)))
    assert (wrong - exact).norm() > 0.1 * exact.norm()
    torch.testing.assert_close(right, exact, rtol=1e-10, atol=1e-12)
