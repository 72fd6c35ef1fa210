"""RL shared-prefix rows against the duplicated layout: tokens, whole-GPT-step time, attention time, memory.

GRPO-style post-training samples ``n`` responses of ``R`` tokens per prompt of ``P`` tokens.
For each ``(P, n)``, one training row per step, side by side in one run:

* ``duplicated``: each response after its own copy of the prompt, ordinary packed causal
  documents (``n x (P + R)`` tokens; the prompt is computed ``n`` times in every layer);
* ``shared``: `primus_ext.megatron.pack_shared_prefix` (``P + n x R`` tokens), the prompt once,
  its responses after it, run by the layers as the tree mask (B37).

Both rows score the same ``n x R`` response tokens (the loss of the duplicated row is read at
the same positions the shared row's `SharedPrefixBatch.sequence_losses` reads), and two models
built from the same seed take them, so their first losses must agree (reported).  Measured:

* ``step``: a tiny megatron-core GPT (2 layers, hidden 64, 4 heads / 2 query groups, head
  dim 16, vocab 64, learned absolute positions), forward + backward + Adam step;
* ``attention``: one layer's core attention alone, forward + backward on the same q/k/v
  shapes: `primus_ext.call.shared_prefix.shared_prefix_attention` for the shared row, the
  adapter's ``varlen`` call on the duplicated documents;
* ``pairs``: the (query, key) pairs each mask allows, shared / duplicated: what the attention
  ratio approaches where attention time is proportional to the pairs scored;
* memory: on CPU, the peak of torch tensor bytes allocated during the first (warm-up) call of
  each candidate above those live before it (the profiler's allocation events, in time order:
  activations, gradients and temporaries; not Python objects, not freed-but-kept heap); on a
  GPU ``torch.cuda.max_memory_allocated`` over that call, less what was allocated before it.

Paths: on CPU the flex path on the ``reference`` backend, float32.  On a GPU
(``torch.cuda.is_available()``), bf16: the flex path on Primus-Turbo's kernels (``turbo``) and
the direct varlen path (``use_turbo_flex_attention: false``), both where ``primus_turbo`` imports,
and the ``flex`` backend (torch FlexAttention, one call on the row's tree mask).  ``--fake`` runs the Primus-Turbo paths on primus_ext's CPU
fake (gfx942) instead, to check this code without a GPU; its times are the fake's, not a GPU's.

No goal is set for these rows: they report.

    python -m benchmarks.shared_prefix [--prompts 1024 4096] [--responses 4 16] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from . import _common as c

NAME = "shared_prefix"
PROMPTS = (1024, 4096)
RESPONSES = (4, 16)
RESPONSE_LEN = 512
VOCAB = 64
LAYERS, HIDDEN, HEADS, GROUPS = 2, 64, 4, 2
HEAD_DIM = HIDDEN // HEADS


# -- the rows --------------------------------------------------------------------
def pairs(prompt: int, responses: int, length: int) -> tuple[int, int]:
    """(query, key) pairs the duplicated and the shared masks allow (causal pairs include the diagonal)."""
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    return responses * tri(prompt + length), tri(prompt) + responses * (tri(length) + length * prompt)


class Rows:
    """The duplicated and the shared row of one prompt and its responses, on ``device``, with the positions
    of the logits that predict each response token in each."""

    def __init__(self, prompt: int, responses: int, length: int, device: torch.device) -> None:
        from megatron.core.packed_seq_params import PackedSeqParams

        from primus_ext.megatron import pack_shared_prefix

        gen = torch.Generator().manual_seed(prompt * 1000 + responses)
        p = torch.randint(0, VOCAB, (prompt,), generator=gen)
        rs = [torch.randint(0, VOCAB, (length,), generator=gen) for _ in range(responses)]
        self.shared = pack_shared_prefix([(p.to(device), [r.to(device) for r in rs])])
        doc = prompt + length
        self.tokens = torch.cat([torch.cat([p, r]) for r in rs]).reshape(1, -1).to(device)
        self.positions = torch.arange(doc).repeat(responses).reshape(1, -1).to(device)
        self.cu = torch.arange(0, responses * doc + 1, doc, dtype=torch.int32, device=device)
        self.params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu,
                                      max_seqlen_q=doc, max_seqlen_kv=doc)
        starts = torch.arange(responses) * doc
        # in each copy, the logits at prompt-1 .. doc-2 predict the response's tokens
        self.at = (starts[:, None] + torch.arange(prompt - 1, doc - 1)[None, :]).reshape(-1).to(device)
        self.targets = torch.stack(rs).reshape(-1).to(device)
        self.doc, self.count = doc, responses * length

    def duplicated_loss(self, model: Any) -> torch.Tensor:
        out = model(self.tokens, self.positions, None, packed_seq_params=self.params)
        flat = out.reshape(-1, VOCAB).index_select(0, self.at).float()
        return F.cross_entropy(flat, self.targets, reduction="sum") / self.count

    def shared_loss(self, model: Any) -> torch.Tensor:
        b = self.shared
        out = model(b.tokens, b.position_ids, None, packed_seq_params=b.packed_seq_params)
        return b.sequence_losses(out.float()).sum() / self.count


# -- paths -----------------------------------------------------------------------
def _keys(path: str) -> dict[str, Any]:
    base = {"use_turbo_attention": True, "packed_sequences": True}
    if path == "reference":
        return {**base, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "reference"}
    if path == "turbo":
        return {**base, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "turbo"}
    if path == "flex":
        return {**base, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "flex"}
    return {**base, "use_turbo_flex_attention": False}  # direct


def _settings(path: str, shared: bool, arch: Optional[str]) -> Any:
    from primus_ext.settings import TurboAttentionSettings

    extra = {"turbo_arch": arch} if arch and path in ("turbo", "direct") else {}
    return TurboAttentionSettings.from_dict({**_keys(path), "packed_shared_prefix": shared, **extra})


def _model(settings: Any, dtype: torch.dtype, device: torch.device, max_len: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_ext.megatron import get_gpt_layer_primus_turbo_local_spec, prepare_shared_prefix

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)  # the same weights for both rows
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_primus_turbo_local_spec(settings),
                     vocab_size=VOCAB, max_sequence_length=max_len, position_embedding_type="learned_absolute")
    model = model.to(device=device, dtype=dtype)
    return prepare_shared_prefix(model) if settings.packed_shared_prefix else model


def _adapter(settings: Any, dtype: torch.dtype, max_len: int) -> Any:
    from primus_ext.call.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan

    facts = LayerFacts(num_heads=HEADS, num_kv_heads=GROUPS, head_dim=HEAD_DIM, seq_length=max_len, packed=True,
                       dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype])
    return TurboFlexAttention(build_plan(settings, facts))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _stepper(model: Any, loss: Callable[[Any], torch.Tensor], device: torch.device,
             record: list) -> Callable[[], None]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        value = loss(model)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        _sync(device)
        if not record:
            record.append(float(value.detach()))  # the first loss, before any update

    return step


def _attention(adapter: Any, rows: Rows, shared: bool, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    from primus_ext.call.shared_prefix import shared_prefix_attention

    total = rows.shared.layout.total if shared else rows.tokens.shape[1]
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(total, GROUPS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(device, dtype)

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        if shared:
            out = shared_prefix_attention(adapter, q, k, v, rows.shared.layout)
        else:
            out = adapter.varlen(q, k, v, rows.cu, rows.cu, rows.doc, rows.doc, causal=True)
        out.backward(grad)
        _sync(device)

    return run


# -- memory ----------------------------------------------------------------------
def peak_mib(fn: Callable[[], None], device: torch.device) -> float:
    """Peak tensor memory allocated while ``fn`` runs, above what was allocated before it, in MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []

    def walk(nodes: Any) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                sizes.append((node.start_time_ns, node.extra_fields.alloc_size))  # frees are negative
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(sizes, key=lambda s: s[0]):
        live += size
        peak = max(peak, live)
    return peak / 2**20


# -- one configuration -----------------------------------------------------------
def measure(path: str, prompt: int, responses: int, length: int, repeats: int, device: torch.device,
            dtype: torch.dtype, arch: Optional[str]) -> dict[str, Any]:
    rows = Rows(prompt, responses, length, device)
    max_len = prompt + length
    first: dict[str, list] = {"duplicated": [], "shared": []}
    candidates: dict[str, Callable[[], None]] = {}
    settings = _settings(path, True, arch)
    candidates["duplicated step"] = _stepper(_model(settings, dtype, device, max_len), rows.duplicated_loss,
                                             device, first["duplicated"])
    candidates["shared step"] = _stepper(_model(settings, dtype, device, max_len), rows.shared_loss, device,
                                         first["shared"])
    if path in ("reference", "turbo", "flex"):  # the flex path's adapter alone (the direct path has none)
        adapter = _adapter(settings, dtype, max_len)
        candidates["duplicated attention"] = _attention(adapter, rows, False, dtype, device)
        candidates["shared attention"] = _attention(adapter, rows, True, dtype, device)
    memory = {name: peak_mib(fn, device) for name, fn in candidates.items()}  # also the warm-up call
    timing = c.interleaved(candidates, repeats=repeats, scale=1e3)
    dup_pairs, shared_pairs = pairs(prompt, responses, length)
    result: dict[str, Any] = {
        "path": path, "prompt": prompt, "responses": responses, "response_len": length,
        "tokens": {"duplicated": rows.tokens.shape[1], "shared": rows.shared.layout.total},
        "scored_tokens": rows.count, "timing_ms": timing, "peak_mib": memory,
        "pairs": {"duplicated": dup_pairs, "shared": shared_pairs}, "pairs_ratio": shared_pairs / dup_pairs,
        "first_loss": {k: v[0] if v else None for k, v in first.items()},
    }
    result["step_ratio"] = timing["shared step"]["median"] / timing["duplicated step"]["median"]
    if "shared attention" in timing:
        result["attention_ratio"] = timing["shared attention"]["median"] / timing["duplicated attention"]["median"]
    a, b = result["first_loss"]["duplicated"], result["first_loss"]["shared"]
    result["first_loss_rel_diff"] = abs(a - b) / abs(a)
    return result


# -- main ------------------------------------------------------------------------
def _paths(device: torch.device, fake: bool) -> tuple[list[str], dict[str, str]]:
    """The paths to measure here, and those that are not, with why."""
    if fake:
        return ["turbo", "direct"], {"reference": "left out with --fake", "flex": "needs a GPU"}
    if device.type != "cuda":
        why = "not measured here: needs a GPU (this machine has none)"
        return ["reference"], {"flex": why, "turbo": why, "direct": why}
    import importlib.util

    if importlib.util.find_spec("primus_turbo") is None:
        why = "not measured: primus_turbo does not import here (Primus-Turbo's kernels are ROCm's)"
        return ["flex"], {"turbo": why, "direct": why}
    return ["flex", "turbo", "direct"], {}


@contextlib.contextmanager
def _kernels(fake: bool) -> Iterator[None]:
    if not fake:
        yield
        return
    from primus_ext.testing import fake_primus_turbo

    with fake_primus_turbo(arch="gfx942", log_size=16):
        yield


def _ms(t: dict[str, float]) -> str:
    return f"{t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})"


def _row(r: dict[str, Any]) -> list[Any]:
    """One line of the table: a missing figure (a refused shared row, no separate attention) is ``-``."""
    t, m = r["timing_ms"], r["peak_mib"]

    def both(values: dict[str, Any], what: str, fmt: Callable[[Any], str]) -> str:
        return " / ".join(fmt(values[f"{side} {what}"]) if f"{side} {what}" in values else "-"
                          for side in ("duplicated", "shared"))

    ratio = lambda key: f"{r[key]:.2f}x" if key in r else "-"  # noqa: E731
    prompt = r["prompt"]
    return [r["path"], f"{prompt // 1024}k" if prompt % 1024 == 0 else prompt, r["responses"],
            f"{r['tokens']['duplicated']} / {r['tokens']['shared']}",
            _ms(t["duplicated step"]), _ms(t["shared step"]) if "shared step" in t else "-",
            ratio("step_ratio"), both(t, "attention", lambda x: f"{x['median']:.0f}"), ratio("attention_ratio"),
            ratio("pairs_ratio"), both(m, "step", lambda x: f"{x:.0f}"), both(m, "attention", lambda x: f"{x:.0f}"),
            f"{r['first_loss_rel_diff']:.1e}" if "first_loss_rel_diff" in r else "-"]


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), help="prompt lengths (P)")
    parser.add_argument("--responses", type=int, nargs="+", default=list(RESPONSES), help="responses per prompt (n)")
    parser.add_argument("--response-len", type=int, default=RESPONSE_LEN, help="tokens per response (R)")
    parser.add_argument("--repeats", type=int, default=3, help="timed samples per candidate, after one warm-up")
    parser.add_argument("--quick", action="store_true", help="P = 1k, n = 4 only, 2 samples (about a minute)")
    parser.add_argument("--fake", action="store_true", help="the Primus-Turbo paths on the CPU fake (gfx942), bf16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.responses, args.repeats = [1024], [4], 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.fake else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" or args.fake else torch.float32
    started, env = c.begin(NAME, "shared-prefix rows vs the duplicated layout: tokens, GPT step, attention, memory",
                           args.threads)
    env["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    paths, absent = _paths(device, args.fake)
    from primus_ext.cli import demo_model as dm

    results, rows = [], []
    with dm.single_process_world(), _kernels(args.fake):
        for path in paths:
            for prompt in args.prompts:
                for n in args.responses:
                    r = measure(path, prompt, n, args.response_len, args.repeats, device, dtype,
                                "gfx942" if args.fake else None)
                    results.append(r)
                    rows.append(_row(r))
                    print(f"  measured {path} P={prompt} n={n} ({time.perf_counter() - started:.0f} s)", flush=True)
    print()
    print(c.table(["path", "P", "n", "tokens dup / shared", "step dup ms med (min-max)", "step shared ms med (min-max)",
                   "step shared/dup", "attention ms dup / shared", "attention shared/dup", "pairs shared/dup",
                   "step peak MiB dup / shared", "attention peak MiB dup / shared", "first-loss rel diff"], rows))
    for path, why in absent.items():
        print(f"{path}: {why}")
    print(f"\nR = {args.response_len}; GPT: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {GROUPS} query groups, "
          f"vocab {VOCAB}, {str(dtype).replace('torch.', '')}, learned absolute positions, Adam; medians of "
          f"{args.repeats} interleaved samples after one warm-up (min-max in brackets); attention: one layer's core "
          f"attention, forward + backward; peak MiB: tensor memory of the warm-up call above what was live before it "
          f"({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'profiler allocation events'}); "
          f"{args.threads} intra-op thread(s).")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "threads": args.threads,
                               "repeats": args.repeats, "device": str(device), "dtype": str(dtype),
                               "fake": args.fake, "results": results, "not_measured": absent})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
