"""Hook resolution: a bad mask_mod / score_mod is refused at build time (B2), never later,
and a config only names hooks: it never gets a program run (B32).

User hooks are written as real modules under ``tmp_path`` and put on ``sys.path``, so
import, attribute lookup, arity and probing run exactly as they would for a user's
package.  Every refusal must name the setting key and quote the hook string.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

import primus_ext
from primus_ext.attention import library, masks
from primus_ext.backends.exact import mask_from_mask_mod
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import LayerFacts, build_plan
from primus_ext.settings import TurboAttentionSettings
from primus_ext.settings.hooks import resolve_hook, resolve_hooks

from . import hook_modules

MASK_KEY = "turbo_flex_attention_mask_mod"
SCORE_KEY = "turbo_flex_attention_score_mod"


def refused(spec: str, *, kind: str = "mask_mod", kwargs: Optional[dict] = None) -> str:
    setting = MASK_KEY if kind == "mask_mod" else SCORE_KEY
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hook(spec, kind=kind, setting=setting, kwargs=kwargs)  # type: ignore[arg-type]
    text = str(info.value)
    assert setting in info.value.settings
    assert setting in text and repr(spec) in text
    return text


def dense(mask_mod: Callable, n: int = 8) -> torch.Tensor:
    return mask_from_mask_mod(mask_mod, 1, 1, n, n, torch.device("cpu")).expand(1, 1, n, n)[0, 0]


# --------------------------------------------------------------- mask library
def test_library_factory_with_empty_kwargs_resolves_to_the_mask() -> None:
    mask = resolve_hook("primus_ext.attention.masks:causal", kind="mask_mod", setting=MASK_KEY, kwargs={})
    assert torch.equal(dense(mask), torch.ones(8, 8, dtype=torch.bool).tril())


def test_library_factory_with_kwargs() -> None:
    mask = resolve_hook("primus_ext.attention.masks:prefix_lm", kind="mask_mod", setting=MASK_KEY,
                        kwargs={"prefix_length": 3})
    assert torch.equal(dense(mask), dense(masks.prefix_lm(3)))
    window = resolve_hook("primus_ext.attention.masks:sliding_window", kind="mask_mod",
                          setting=MASK_KEY, kwargs={"left": 2})
    assert torch.equal(dense(window), dense(masks.sliding_window(2, 0)))


def test_library_factory_without_kwargs_is_refused_with_a_factory_hint() -> None:
    text = refused("primus_ext.attention.masks:causal", kwargs=None)
    assert f"{MASK_KEY}_kwargs: {{}}" in text


def test_factory_failing_on_its_kwargs_names_the_kwargs_key() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hook("primus_ext.attention.masks:prefix_lm", kind="mask_mod", setting=MASK_KEY,
                     kwargs={"prefix_len": 3})
    assert f"{MASK_KEY}_kwargs" in info.value.settings
    assert "prefix_len" in str(info.value) and "TypeError" in str(info.value)
    text = refused("primus_ext.attention.masks:prefix_lm", kwargs={"prefix_length": -1})
    assert "prefix_length must be >= 0" in text


def test_attribute_itself_is_the_hook_when_kwargs_are_null(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        def document_mask(b, h, q_idx, kv_idx):
            return (q_idx // 4) == (kv_idx // 4)
    """)
    module = __import__(name)
    before = dict(vars(module.document_mask))
    hook = resolve_hook(f"{name}:document_mask", kind="mask_mod", setting=MASK_KEY)
    assert hook is module.document_mask
    assert vars(hook) == before  # nothing attached to the user's function


# ---------------------------------------------------------------- lookups
def test_missing_module() -> None:
    text = refused("no_such_package_xyz.masks:causal")
    assert "not found" in text and "no_such_package_xyz" in text


def test_import_error_inside_the_module_is_reported(user_module: Callable[[str], str]) -> None:
    missing_dep = user_module("import definitely_not_installed_dep\n")
    text = refused(f"{missing_dep}:mask")
    assert "importing" in text and "definitely_not_installed_dep" in text
    broken = user_module("raise RuntimeError('config server unreachable')\n")
    text = refused(f"{broken}:mask")
    assert "RuntimeError: config server unreachable" in text


def test_missing_attribute_suggests_close_names() -> None:
    text = refused("primus_ext.attention.masks:casual", kwargs={})
    assert "no attribute `casual`" in text and "`primus_ext.attention.masks:causal`" in text


def test_dotted_attribute_path(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        class Masks:
            @staticmethod
            def causal(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx
    """)
    hook = resolve_hook(f"{name}:Masks.causal", kind="mask_mod", setting=MASK_KEY)
    assert torch.equal(dense(hook), torch.ones(8, 8, dtype=torch.bool).tril())
    text = refused(f"{name}:Masks.casual")
    assert f"`{name}:Masks` has no attribute `casual`" in text


def test_non_callable_attribute(user_module: Callable[[str], str]) -> None:
    name = user_module("WINDOW = 128\n")
    assert "not a callable" in refused(f"{name}:WINDOW")


@pytest.mark.parametrize("spec", ["no_colon", "pkg.mod:", "pkg.mod:f()", "__import__('os'):x"])
def test_malformed_hook_strings(spec: str) -> None:
    assert "package.module:attr" in refused(spec)


def test_factory_returning_a_non_callable(user_module: Callable[[str], str]) -> None:
    name = user_module("from primus_ext import hook_factory\n@hook_factory\ndef make(size):\n    return size\n")
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hook(f"{name}:make", kind="mask_mod", setting=MASK_KEY, kwargs={"size": 4})
    assert info.value.settings == (MASK_KEY, f"{MASK_KEY}_kwargs")
    assert "returned a value of type int" in str(info.value)


# ------------------------------------------------------------------ arity
@pytest.mark.parametrize("signature,count", [("(b, h, q_idx)", "too few"),
                                             ("(q_idx, kv_idx)", "too few"),
                                             ("(b, h, q_idx, kv_idx, extra)", "too many"),
                                             ("(b, h, q_idx, kv_idx, *, doc_ids)", "keyword-only"),
                                             ("()", "too few")])
def test_mask_mod_with_wrong_arity(user_module: Callable[[str], str], signature: str, count: str) -> None:
    name = user_module(f"def mask{signature}:\n    return True\n")
    text = refused(f"{name}:mask")
    assert "signature" in text and count in text
    opposite = {"too few": "too many", "too many": "too few"}.get(count)
    assert opposite is None or opposite not in text


def test_score_mod_with_mask_mod_arity(user_module: Callable[[str], str]) -> None:
    name = user_module("def bias(b, h, q_idx, kv_idx):\n    return q_idx - kv_idx\n")
    text = refused(f"{name}:bias", kind="score_mod")
    assert "score_mod(score, b, h, q_idx, kv_idx)" in text


def test_extra_defaulted_parameters_are_accepted(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        def causal(b, h, q_idx, kv_idx, offset=0):
            return kv_idx <= q_idx + offset
    """)
    resolve_hook(f"{name}:causal", kind="mask_mod", setting=MASK_KEY)


# ------------------------------------------------------------------ probe
@pytest.mark.parametrize("body,expected", [
    ("return (kv_idx <= q_idx).float()", "torch.float32"),
    ("return q_idx - kv_idx", "torch.int64"),
    ("return True", "returned a value of type bool"),
    ("return None", "returned a value of type NoneType"),
    ("return torch.ones(3, dtype=torch.bool)", "does not broadcast"),
])
def test_mask_mod_must_return_a_boolean_tensor(user_module: Callable[[str], str], body: str,
                                               expected: str) -> None:
    name = user_module(f"import torch\ndef mask(b, h, q_idx, kv_idx):\n    {body}\n")
    assert expected in refused(f"{name}:mask")


def test_mask_mod_raising_on_the_probe_is_reported(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        def python_branch(b, h, q_idx, kv_idx):
            if q_idx >= kv_idx:   # data-dependent Python control flow
                return True
            return False

        def boom(b, h, q_idx, kv_idx):
            raise KeyError("doc_ids not loaded")
    """)
    assert "ambiguous" in refused(f"{name}:python_branch")
    assert "KeyError" in refused(f"{name}:boom") and "doc_ids not loaded" in refused(f"{name}:boom")


@pytest.mark.parametrize("body,expected", [
    ("return score > 0", "torch.bool"),
    ("return (q_idx - kv_idx)", "torch.int64"),
    ("return score.sum()", "not the score's shape"),
    ("return score[..., :1]", "not the score's shape"),
    ("return 0.0", "returned a value of type float"),
    ("raise ValueError('bad table')", "ValueError: bad table"),
])
def test_score_mod_must_return_a_float_tensor_shaped_like_score(
        user_module: Callable[[str], str], body: str, expected: str) -> None:
    name = user_module(f"import torch\ndef mod(score, b, h, q_idx, kv_idx):\n    {body}\n")
    assert expected in refused(f"{name}:mod", kind="score_mod")


def test_valid_score_mod_factory(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        import torch
        from primus_ext import hook_factory

        @hook_factory
        def softcap(cap):
            def mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)
            return mod
    """)
    mod = resolve_hook(f"{name}:softcap", kind="score_mod", setting=SCORE_KEY, kwargs={"cap": 30.0})
    score = torch.randn(1, 1, 4, 4)
    idx = torch.zeros((), dtype=torch.long)
    assert torch.allclose(mod(score, idx, idx, idx, idx), 30.0 * torch.tanh(score / 30.0))


# ------------------------------------------------------------ resolve_hooks
FLEX_ON = {"use_turbo_attention": True, "use_turbo_flex_attention": True}


def test_resolve_hooks_with_no_hooks() -> None:
    assert resolve_hooks(TurboAttentionSettings()) == (None, None)


def test_resolve_hooks_returns_both(user_module: Callable[[str], str]) -> None:
    name = user_module("def bias(score, b, h, q_idx, kv_idx):\n    return score - (q_idx - kv_idx).abs()\n")
    settings = TurboAttentionSettings.from_dict({
        **FLEX_ON,
        MASK_KEY: "primus_ext.attention.masks:chunked", f"{MASK_KEY}_kwargs": {"chunk_size": 4},
        SCORE_KEY: f"{name}:bias",
    })
    mask_mod, score_mod = resolve_hooks(settings)
    assert torch.equal(dense(mask_mod), dense(masks.chunked(4)))
    assert score_mod is sys.modules[name].bias


def test_resolve_hooks_reports_both_failures_at_once(user_module: Callable[[str], str]) -> None:
    name = user_module("def bias(b, h, q_idx, kv_idx):\n    return q_idx\n")
    settings = TurboAttentionSettings.from_dict({
        **FLEX_ON, MASK_KEY: "missing_pkg_abc:mask", SCORE_KEY: f"{name}:bias",
    })
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hooks(settings)
    assert len(info.value.reasons) == 2
    text = str(info.value)
    assert "'missing_pkg_abc:mask'" in text and f"'{name}:bias'" in text
    assert set(info.value.settings) == {MASK_KEY, SCORE_KEY}


# -------------------------------------------------- B32: a config only names hooks
HOOKS = "tests.hook_modules"


def refused_b32(spec: str, *, kind: str = "mask_mod", kwargs: Optional[dict] = None) -> str:
    text = refused(spec, kind=kind, kwargs=kwargs)
    assert "(B32)" in text and "Alternative:" in text
    return text


@pytest.fixture
def no_calls() -> Callable[[], None]:
    """Clear the recorder of `tests.hook_modules`; the returned check fails if anything ran."""
    hook_modules.CALLS.clear()
    return lambda: None if not hook_modules.CALLS else pytest.fail(f"called: {hook_modules.CALLS}")


def test_shell_command_through_subprocess_run_is_refused_and_never_runs(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    shell = {"args": f"touch {pwned}", "shell": True}
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hook("subprocess:run", kind="mask_mod", setting=MASK_KEY, kwargs=shell)
    assert info.value.codes == ("B32",) and MASK_KEY in info.value.settings
    assert "standard-library" in str(info.value) and "not imported" in str(info.value)
    settings = TurboAttentionSettings.from_dict({**FLEX_ON, "turbo_flex_attention_backend": "reference",
                                                 MASK_KEY: "subprocess:run", f"{MASK_KEY}_kwargs": shell,
                                                 SCORE_KEY: "subprocess:run", f"{SCORE_KEY}_kwargs": shell})
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hooks(settings)
    assert info.value.codes == ("B32", "B32") and {MASK_KEY, SCORE_KEY} <= set(info.value.settings)
    with pytest.raises(UnsupportedConfigError) as info:
        build_plan(settings, LayerFacts(num_heads=4, head_dim=8, seq_length=8))
    assert "B32" in info.value.codes and "'subprocess:run'" in str(info.value)
    assert not pwned.exists()


def test_a_stdlib_module_is_refused_before_it_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "this", raising=False)  # importing `this` prints the Zen
    refused_b32("this:s")
    refused_b32("os.path:join")
    assert "this" not in sys.modules


@pytest.mark.parametrize("spec,kwargs", [
    ("os:system", {"command": "echo B32"}),
    ("builtins:eval", None),
    ("functools:partial", {}),
    ("operator:le", None),
    ("subprocess:run", None),
])
def test_stdlib_and_builtin_callables_are_refused(spec: str, kwargs: Optional[dict]) -> None:
    text = refused_b32(spec, kwargs=kwargs)
    assert f"`{spec.split(':')[0]}` is a standard-library, builtins or torch module" in text


@pytest.mark.parametrize("attr,what", [
    ("functools.partial", "the class `functools.partial`"),
    ("functools.wraps", "standard library module `functools`"),
    ("torch.logical_and", "built-in (C) function"),
    ("recorder", "callable `Recorder` instance"),
    ("recorder_partial", "functools.partial"),
    ("Recorder", "the class"),
    ("recorder.__call__", "bound method"),
])
def test_after_import_only_plain_functions_outside_the_stdlib_are_called(
        attr: str, what: str, no_calls: Callable[[], None]) -> None:
    for kwargs in (None, {}):
        text = refused_b32(f"{HOOKS}:{attr}", kwargs=kwargs)
        assert what in text and "plain Python function" in text
    no_calls()


def test_unmarked_factory_with_kwargs_is_refused_uncalled(no_calls: Callable[[], None]) -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        resolve_hook(f"{HOOKS}:band", kind="mask_mod", setting=MASK_KEY, kwargs={"width": 2})
    err = info.value
    assert err.settings == (MASK_KEY, f"{MASK_KEY}_kwargs") and err.codes == ("B32",)
    assert "@primus_ext.hook_factory" in str(err) and f"{MASK_KEY}_kwargs: null" in str(err)
    no_calls()


def test_marked_factories_are_called_with_their_kwargs() -> None:
    mask = resolve_hook(f"{HOOKS}:marked_band", kind="mask_mod", setting=MASK_KEY, kwargs={"width": 1})
    idx = torch.arange(8)
    assert torch.equal(dense(mask), (idx[:, None] - idx[None, :]).abs() <= 1)
    mod = resolve_hook(f"{HOOKS}:marked_softcap", kind="score_mod", setting=SCORE_KEY, kwargs={"cap": 5.0})
    score = torch.randn(1, 1, 4, 4)
    assert torch.allclose(mod(score, idx, idx, idx, idx), 5.0 * torch.tanh(score / 5.0))
    assert primus_ext.hook_factory is library.hook_factory


def test_marked_factory_without_kwargs_asks_for_them() -> None:
    text = refused(f"{HOOKS}:marked_band")
    assert f"{MASK_KEY}_kwargs: {{}}" in text and f"{MASK_KEY}_kwargs: {{width: ...}}" in text


def test_a_marked_factory_must_return_a_plain_function(no_calls: Callable[[], None]) -> None:
    text = refused_b32(f"{HOOKS}:returns_a_partial", kwargs={"width": 1})
    assert "the factory returned a functools.partial" in text


@pytest.mark.parametrize("factory,kwargs", [
    ("full", {}), ("causal", {}), ("sliding_window", {"left": 2, "right": 1}),
    ("packed_documents", {"cu_seqlens": [0, 3, 8]}), ("prefix_lm", {"prefix_length": 3}),
    ("chunked", {"chunk_size": 4, "causal": False}),
])
def test_every_library_mask_factory_is_still_accepted(factory: str, kwargs: dict) -> None:
    mask = resolve_hook(f"primus_ext.attention.masks:{factory}", kind="mask_mod", setting=MASK_KEY,
                        kwargs=kwargs)
    assert torch.equal(dense(mask), dense(getattr(masks, factory)(**kwargs)))


def test_a_wraps_wrapper_is_not_the_library_mask_it_wraps() -> None:
    wrapper = hook_modules.wrapped_causal
    assert library.library_pattern(hook_modules.LIBRARY_CAUSAL) is not None
    assert library.library_pattern(wrapper) is None and not library.is_library_mask(wrapper)
    assert wrapper.__wrapped__ is hook_modules.LIBRARY_CAUSAL  # it does look like the library mask
    hook = resolve_hook(f"{HOOKS}:wrapped_causal", kind="mask_mod", setting=MASK_KEY)
    assert hook is wrapper and dense(hook)[0].all()  # a user function: row 0 sees every key


@pytest.mark.parametrize("attr,words", [("two_arguments", "takes 2 positional arguments, too few"),
                                        ("six_required", "requires 6 positional arguments, too many")])
def test_arity_says_too_few_or_too_many(attr: str, words: str) -> None:
    assert words in refused(f"{HOOKS}:{attr}")
