"""B37 through a real megatron-core GPT on CPU: a shared-prefix row (each prompt once, its responses after it)
gives every response the loss, and every parameter the gradient, of the duplicated layout (each response packed
after its own copy of the prompt, as ordinary documents), on `reference` in float64 and on the fake's kernels at
gfx942 and gfx950 (and the direct path), with learned absolute positions and with RoPE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import get_gpt_layer_primus_turbo_local_spec, pack_shared_prefix, prepare_shared_prefix
from primus_ext.testing import fake_primus_turbo

from . import gpt

GROUPS = [(6, [3, 5, 1]), 4, (5, [2, 0, 3])]  # trees (prompt, responses) and a document, as token counts


@pytest.fixture(autouse=True)
def rope_on_cpu(monkeypatch):
    """megatron-core 0.16.1's RotaryEmbedding.get_emb moves its table to ``torch.cuda.current_device()`` at the first
    forward (rotary_pos_embedding.py l.160-162): on this CPU-only machine that device is the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _groups(seed: int = 5) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, gpt.VOCAB, (n,), generator=gen)  # noqa: E731
    return [tokens(g) if isinstance(g, int) else (tokens(g[0]), [tokens(r) for r in g[1]]) for g in GROUPS]


def _model(keys: dict, position: str, dtype: torch.dtype, seed: int = 0, **cfg_keys: Any) -> GPTModel:
    torch.manual_seed(seed)
    cfg = gpt.config(params_dtype=dtype, **({"bf16": True} if dtype == torch.bfloat16 else {}), **cfg_keys)
    settings = gpt.settings(packed_sequences=True, packed_shared_prefix=True, **keys)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_primus_turbo_local_spec(settings),
                     vocab_size=gpt.VOCAB, max_sequence_length=64, position_embedding_type=position,
                     parallel_output=False)  # whole-vocabulary logits on every TP rank
    return model.to(dtype)


def _duplicated_losses(model: GPTModel, groups: list[Any]) -> torch.Tensor:
    """Per sequence (each document; each response with its copy of the prompt), the summed next-token loss of the
    tokens the shared row predicts: a document's, a response's (not the prompt's)."""
    docs, scored = [], []
    for group in groups:
        if isinstance(group, torch.Tensor):
            docs.append(group.reshape(1, -1))
            scored.append(1)
            continue
        prompt, responses = group
        for response in responses:
            docs.append(torch.cat([prompt, response]).reshape(1, -1))
            scored.append(max(prompt.numel(), 1))
    tokens, pos, cu, _ = gpt.pack(docs)
    out = model(tokens, pos, None, packed_seq_params=gpt.thd_params(cu)).reshape(-1, gpt.VOCAB)
    work = torch.promote_types(out.dtype, torch.float32)
    losses = []
    for doc, first, start in zip(docs, scored, cu.tolist()):
        n = doc.shape[1]
        at = torch.arange(start + first - 1, start + n - 1)
        losses.append(F.cross_entropy(out.index_select(0, at).to(work), doc[0, first:], reduction="sum"))
    return torch.stack(losses)


def _shared_losses(model: GPTModel, groups: list[Any]) -> torch.Tensor:
    batch = pack_shared_prefix(groups)
    out = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    return batch.sequence_losses(out)


def _compare(keys: dict, position: str, dtype: torch.dtype, tol: float, **cfg_keys: Any) -> None:
    groups = _groups()
    model = prepare_shared_prefix(_model(keys, position, dtype, **cfg_keys))
    shared = _shared_losses(model, groups)
    grads_shared = torch.autograd.grad(shared.sum(), list(model.parameters()), allow_unused=True)
    duplicated = _duplicated_losses(model, groups)
    grads_dup = torch.autograd.grad(duplicated.sum(), list(model.parameters()), allow_unused=True)
    assert shared.shape == duplicated.shape == (7,)
    assert torch.allclose(shared.double(), duplicated.double(), rtol=tol, atol=tol), (shared, duplicated)
    for (name, _), g, w in zip(model.named_parameters(), grads_shared, grads_dup):
        assert (g is None) == (w is None), name
        if g is not None:  # against the gradient's own scale: a 16-bit model rounds each entry to it
            error = (g.double() - w.double()).abs().max().item()
            assert error <= tol * max(w.double().abs().max().item(), 1.0), (name, error)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_shared_rows_equal_the_duplicated_layout_on_reference_in_float64(position):
    _compare(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), position,
             torch.float64, 1e-10)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("flex", [True, False])
def test_shared_rows_equal_the_duplicated_layout_on_the_fakes_kernels(arch, flex):
    keys = dict(use_turbo_flex_attention=flex, turbo_arch=arch)
    if flex:
        keys["turbo_flex_attention_backend"] = "turbo"
    with fake_primus_turbo(arch=arch) as fake:
        _compare(keys, "rope", torch.bfloat16, 2e-2)  # the kernels take 16-bit inputs only (B33)
    assert any("varlen" in c.entry or "fwd" in c.entry for c in fake.calls), [c.entry for c in fake.calls][:5]


def test_an_unprepared_model_refuses_a_shared_row_naming_the_fix():
    model = _model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), "learned_absolute",
                   torch.float64)
    with pytest.raises(UnsupportedInputError) as err:
        _shared_losses(model, _groups())
    assert "shared-prefix.positions" in err.value.codes and "prepare_shared_prefix" in str(err.value)


def test_an_unprepared_rope_model_stops_before_any_attention():
    """megatron-core's THD RoPE needs the boundaries the row gets only from a prepared forward: it fails there
    (megatron-core's own error, before primus_ext's layers can refuse), never trains on wrong positions."""
    model = _model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), "rope",
                   torch.float64)
    with pytest.raises(Exception):
        _shared_losses(model, _groups())


def test_a_model_with_a_layer_not_planned_for_shared_rows_is_refused_when_prepared():
    torch.manual_seed(0)
    settings = gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
    model = GPTModel(config=gpt.config(params_dtype=torch.float64),
                     transformer_layer_spec=get_gpt_layer_primus_turbo_local_spec(settings),
                     vocab_size=gpt.VOCAB, max_sequence_length=64, position_embedding_type="rope").double()
    with pytest.raises(UnsupportedConfigError) as err:
        prepare_shared_prefix(model)
    assert "shared-prefix.model" in err.value.codes and "not planned with packed_shared_prefix: true" in str(err.value)


def test_an_unprepared_foreign_attention_gets_no_boundaries_to_run_documents_by():
    """A model prepare_shared_prefix never saw (any attention, primus_ext's or not) finds no cu_seqlens in a
    shared-prefix row's params, so it cannot run the row as plain documents; a prepared forward fills them in."""
    batch = pack_shared_prefix(_groups())
    params = batch.packed_seq_params
    assert params.cu_seqlens_q is None and params.cu_seqlens_kv is None
    model = prepare_shared_prefix(_model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
                                         "learned_absolute", torch.float64))
    model(batch.tokens, batch.position_ids, None, packed_seq_params=params)
    assert params.cu_seqlens_q is params.layout.segments and params.positions_given


def test_other_position_ids_and_fused_rope_are_refused():
    model = prepare_shared_prefix(_model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
                                         "learned_absolute", torch.float64))
    batch = pack_shared_prefix(_groups())
    with pytest.raises(UnsupportedInputError) as err:
        model(batch.tokens, batch.position_ids.clone(), None, packed_seq_params=batch.packed_seq_params)
    assert "shared-prefix.position-ids" in err.value.codes
    fused = _model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), "rope",
                   torch.float64)
    fused.config.apply_rope_fusion = True
    with pytest.raises(UnsupportedConfigError) as err:
        prepare_shared_prefix(fused)
    assert "apply_rope_fusion" in str(err.value)


def _tp_rank(rank: int, port: int, out_dir: str) -> None:
    from tests.megatron.conftest import gloo_world

    with gloo_world(rank, port, 2, tp=2, timeout_s=300):
        torch.cuda.current_device = lambda: "cpu"  # as `rope_on_cpu`, in this spawned process
        _compare(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), "rope",
                 torch.float64, 1e-10, tensor_model_parallel_size=2, num_attention_heads=4, num_query_groups=2)
        torch.save({"rank": rank}, Path(out_dir) / f"rank{rank}.pt")


def test_shared_rows_equal_the_duplicated_layout_at_tensor_parallel_2(tmp_path):
    """Each TP rank's heads and shards: its losses and every gradient it holds equal the duplicated layout's."""
    from tests.megatron.conftest import spawn_ranks

    assert [r["rank"] for r in spawn_ranks(_tp_rank, 2, tmp_path)] == [0, 1]


def test_a_compiled_model_trains_on_shared_rows_as_eager():
    """torch.compile of the whole prepared GPT (megatron-core's own THD RoPE breaks the graph at its host reads,
    docs/compile.md): the hooks that give the positions run compiled too, and the losses and gradients are eager's."""
    torch._dynamo.reset()
    model = prepare_shared_prefix(_model(dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
                                         "rope", torch.float64))
    groups = _groups()
    eager = _shared_losses(model, groups)
    want = torch.autograd.grad(eager.sum(), list(model.parameters()))
    compiled = torch.compile(model, backend="aot_eager")
    batch = pack_shared_prefix(groups)
    got = batch.sequence_losses(compiled(batch.tokens, batch.position_ids, None,
                                         packed_seq_params=batch.packed_seq_params))
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got.sum(), list(model.parameters())), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, _duplicated_losses(model, groups), rtol=1e-10, atol=1e-12)
