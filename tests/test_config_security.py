"""A config cannot run a program or exhaust memory (issue 24, item 9; rule B32).

* A hook string naming a ``__main__`` module would run that package's command line at
  import; it is refused before anything is imported.
* Whatever an import, a factory or the probe raises, ``SystemExit`` included, is a
  refusal naming the setting; only ``KeyboardInterrupt`` goes through.
* A YAML "billion laughs" file (nested aliases: a few hundred bytes, billions of values)
  is refused by the loader before anything walks it, and every message that quotes a
  user value stays short, however large or shared the value is.
* Hashing settings is linear in the distinct objects of their kwargs, shared or not.

Expanding walks are guarded by `finishes_within`, so a regression fails instead of
running for minutes and gigabytes; the DAG's leaf has a Python ``__repr__`` so that the
alarm also interrupts a C-level ``repr``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError, short_repr
from primus_ext.settings import TurboAttentionSettings
from primus_ext.settings import yaml_file
from primus_ext.settings.hooks import resolve_hook, resolve_hooks
from primus_ext.settings.yaml_file import MAX_YAML_NODES, load_yaml_mapping

MASK_KEY = "turbo_flex_attention_mask_mod"
KWARGS_KEY = f"{MASK_KEY}_kwargs"
FLEX_ON = {"use_turbo_attention": True, "use_turbo_flex_attention": True}
SHORT = 1500  # characters: a refusal quoting a user value stays a few lines long


@contextlib.contextmanager
def finishes_within(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError, instead of hanging, if the block runs longer than ``seconds``."""
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"took more than {seconds} s: a walk expands shared values")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    expired_with = ""
    try:
        yield
    except TimeoutError as exc:  # raised wherever the alarm struck, maybe thousands of frames deep in a parser:
        expired_with = str(exc)  # pytest cannot format such a traceback (an INTERNALERROR ends the whole run)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if expired_with:
        pytest.fail(expired_with, pytrace=False)


def refusal(spec: str, kwargs: Any = None) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as info:  # a SystemExit would escape this
        resolve_hook(spec, kind="mask_mod", setting=MASK_KEY, kwargs=kwargs)
    assert MASK_KEY in info.value.settings and MASK_KEY in str(info.value)
    return info.value


# ------------------------------------------------------------------ __main__ modules
@pytest.mark.parametrize("spec", ["primus_ext.__main__:main", "tqdm.__main__:main",
                                  "numpy.f2py.__main__:main", "__main__:main", "pkg.__main__.cli:run"])
def test_a_main_module_is_refused_without_being_imported(spec: str) -> None:
    module = spec.split(":")[0]
    assert module == "__main__" or module not in sys.modules
    error = refusal(spec, kwargs=None)
    assert error.codes == ("B32",)
    assert "__main__" in str(error) and "not imported" in str(error) and "regular module" in str(error)
    assert module == "__main__" or module not in sys.modules


def test_check_refuses_a_main_hook_without_running_the_cli(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "main_hook.yaml"
    path.write_text(f'use_turbo_attention: true\nuse_turbo_flex_attention: true\nnum_layers: 1\n'
                    f'hidden_size: 64\nnum_attention_heads: 4\n{MASK_KEY}: "primus_ext.__main__:main"\n')
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr()
    assert "B32" in out.out + out.err and "__main__" in out.out + out.err
    assert "primus_ext.__main__" not in sys.modules


# ------------------------------------------------------------ SystemExit is a refusal
def test_a_module_exiting_at_import_is_refused() -> None:
    error = refusal("tests.hook_modules_exit:mask")
    assert "SystemExit" in str(error) and "importing `tests.hook_modules_exit` failed" in str(error)
    assert "tests.hook_modules_exit" not in sys.modules


def test_a_factory_or_probe_raising_system_exit_is_refused(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        import sys
        from primus_ext import hook_factory

        @hook_factory
        def exits(**kwargs):
            sys.exit(3)

        def probe_exits(b, h, q_idx, kv_idx):
            raise SystemExit("bye")
    """)
    error = refusal(f"{name}:exits", kwargs={"width": 2})
    assert KWARGS_KEY in error.settings and "SystemExit: 3" in str(error)
    error = refusal(f"{name}:probe_exits")
    assert "SystemExit: bye" in str(error) and "probed" in str(error)


def test_keyboard_interrupt_still_stops_resolution(user_module: Callable[[str], str]) -> None:
    name = user_module("""
        from primus_ext import hook_factory

        @hook_factory
        def interrupted():
            raise KeyboardInterrupt
    """)
    with pytest.raises(KeyboardInterrupt):
        resolve_hook(f"{name}:interrupted", kind="mask_mod", setting=MASK_KEY, kwargs={})


# ------------------------------------------------------------------- alias bombs
def write_laughs(tmp_path: Path) -> Path:
    """Nine levels of nine aliases each: under 1 kB of YAML, 9**9 strings once expanded."""
    lines = [*(f"{k}: {str(v).lower()}" for k, v in FLEX_ON.items()),
             "num_layers: 1", "hidden_size: 64", "num_attention_heads: 4",
             f'{MASK_KEY}: "primus_ext.attention.masks:causal"',
             "lol0: &lol0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]" for i in range(1, 9)]
    lines.append(f"{KWARGS_KEY}: {{lulz: *lol8}}")
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 1000
    return path


def assert_bomb_refused(error: UnsupportedConfigError, path: Path) -> None:
    text = str(error)
    assert str(path) in error.settings and len(text) < SHORT
    assert f"{MAX_YAML_NODES:,}" in text and "aliases" in text and "Alternative:" in text


def test_loader_refuses_a_billion_laughs_quickly(tmp_path: Path) -> None:
    path = write_laughs(tmp_path)
    with finishes_within(2.0), pytest.raises(UnsupportedConfigError) as info:
        load_yaml_mapping(path)
    assert_bomb_refused(info.value, path)


def test_from_yaml_refuses_a_billion_laughs_quickly(tmp_path: Path) -> None:
    path = write_laughs(tmp_path)
    with finishes_within(2.0), pytest.raises(UnsupportedConfigError) as info:
        TurboAttentionSettings.from_yaml(path)
    assert_bomb_refused(info.value, path)


def test_check_refuses_a_billion_laughs_with_a_short_message(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = write_laughs(tmp_path)
    # The loader must refuse it first; otherwise the CLI would expand it in C (gigabytes).
    with finishes_within(2.0), pytest.raises(UnsupportedConfigError):
        load_yaml_mapping(path)
    with finishes_within(10.0):
        code = main(["check", str(path)])
    out = capsys.readouterr()
    assert code == 2 and len(out.out + out.err) < SHORT
    assert str(path) in out.out + out.err and f"{MAX_YAML_NODES:,}" in out.out + out.err


def test_aliases_are_counted_expanded_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "shared.yaml"
    path.write_text("a: &x [1, 2]\nb: *x\n")  # root + 2 keys + 2 x (list + 2 items) = 9 nodes
    monkeypatch.setattr(yaml_file, "MAX_YAML_NODES", 9)
    assert load_yaml_mapping(path) == {"a": [1, 2], "b": [1, 2]}
    monkeypatch.setattr(yaml_file, "MAX_YAML_NODES", 8)
    with pytest.raises(UnsupportedConfigError, match="more than 8 values"):
        load_yaml_mapping(path)


@pytest.mark.parametrize("text,words", [
    ("a: &a [1, *a]\n", "recursive"),
    ("a: " + "[" * 3000 + "]" * 3000 + "\n", "too deeply"),
    ("a: " + "7" * 5000 + "\n", "cannot build"),
    ("a: 2020-13-45\n", "cannot build"),
    ("? [1, 2]\n: x\n", "unhashable"),
])
def test_other_unbuildable_files_are_refused_naming_the_file(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    # the 3000-deep file takes about 1 s to refuse on an idle core: the bound is for a hang, not a timing
    with finishes_within(20.0), pytest.raises(UnsupportedConfigError) as info:
        load_yaml_mapping(path)
    assert str(path) in info.value.settings and words in str(info.value) and len(str(info.value)) < SHORT


# -------------------------------------------------------- shared values given in Python
class Leaf:
    """Equal to every Leaf; a Python ``__repr__`` lets the alarm interrupt a C-level repr."""

    def __repr__(self) -> str:
        return "Leaf()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Leaf)

    def __hash__(self) -> int:
        return 7


def shared_dag(depth: int = 40) -> dict:
    """``depth`` levels each naming the level below three times: 3**depth paths, 2*depth+1 objects."""
    node: Any = {"leaf": Leaf()}
    for _ in range(depth):
        node = {"a": node, "b": node, "c": [node]}
    return node


def dag_settings(**extra: Any) -> TurboAttentionSettings:
    return TurboAttentionSettings(**FLEX_ON, turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                                  turbo_flex_attention_mask_mod_kwargs={"shared": shared_dag()}, **extra)


def test_hashing_shared_kwargs_is_linear() -> None:
    with finishes_within(2.0):
        settings = dag_settings()
        copy = settings.replace(turbo_arch="auto")  # another deep copy: the same hash
        assert hash(settings) == hash(copy)
        assert hash(settings) != hash(dag_settings(sink_sliding_window=4))


def test_refusing_shared_kwargs_quotes_them_briefly(user_module: Callable[[str], str]) -> None:
    with finishes_within(2.0), pytest.raises(UnsupportedConfigError) as info:
        resolve_hooks(dag_settings())  # prefix_lm takes no `shared` keyword
    text = str(info.value)
    assert KWARGS_KEY in info.value.settings and "unexpected keyword argument 'shared'" in text
    assert len(text) < SHORT
    name = user_module("""
        from primus_ext import hook_factory

        @hook_factory
        def rejects(**kwargs):
            raise ValueError(kwargs)  # an exception carrying the whole value
    """)
    with finishes_within(2.0):
        error = refusal(f"{name}:rejects", kwargs={"shared": shared_dag()})
    assert "ValueError" in str(error) and len(str(error)) < SHORT


def test_a_shared_value_in_a_wrong_setting_is_quoted_briefly() -> None:
    with finishes_within(2.0), pytest.raises(UnsupportedConfigError) as info:
        TurboAttentionSettings(use_turbo_attention=shared_dag())  # type: ignore[arg-type]
    assert "use_turbo_attention must be true or false" in str(info.value) and len(str(info.value)) < SHORT


def test_short_repr_is_bounded_for_any_value() -> None:
    with finishes_within(2.0):
        for value in (shared_dag(), "x" * 10_000, 10 ** 5000, list(range(10_000))):
            assert len(short_repr(value)) <= 200
        assert len(short_repr(shared_dag(), limit=50)) <= 50
    assert short_repr({"prefix_length": 64}) == "{'prefix_length': 64}"


def test_yaml_merge_keys_load_and_an_explicit_key_overrides_a_merged_one(tmp_path):
    """`<<: *anchor` is YAML's own inheritance: loaded, with a key written beside it overriding the
    merged one; a key written twice is still refused."""
    from primus_ext.settings.yaml_file import load_yaml_mapping

    path = tmp_path / "merge.yaml"
    path.write_text("base: &base\n  use_turbo_attention: true\n  sink_sliding_window: 4\n"
                    "layer:\n  <<: *base\n  sink_sliding_window: 8\n")
    assert load_yaml_mapping(path)["layer"] == {"use_turbo_attention": True, "sink_sliding_window": 8}
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(UnsupportedConfigError, match="appears twice"):
        load_yaml_mapping(path)


def test_a_module_getattr_raising_anything_is_refused_with_our_error(tmp_path, monkeypatch):
    (tmp_path / "lazy_hooks.py").write_text(
        "import sys\ndef __getattr__(name):\n    sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from primus_ext.settings.hooks import resolve_hook

    with pytest.raises(UnsupportedConfigError, match="SystemExit") as err:
        resolve_hook("lazy_hooks:mask", kind="mask_mod", setting="turbo_flex_attention_mask_mod")
    assert "turbo_flex_attention_mask_mod" in err.value.settings


def test_a_hook_modules_dir_or_exception_message_raising_is_still_our_refusal(user_module):
    name = user_module('''
        import sys
        def __getattr__(name):
            raise AttributeError(name)
        def __dir__():
            raise SystemExit("dir() ended the program")
        class Weird(Exception):
            def __str__(self):
                raise SystemExit("str() ended the program")
        class Weird2(Exception):
            def __str__(self):
                raise RuntimeError("str() failed")
        def mask(b, h, q_idx, kv_idx):
            raise Weird("boom")
        def mask2(b, h, q_idx, kv_idx):
            raise Weird2("boom")
    ''')
    from primus_ext.settings.hooks import resolve_hook

    for attr, text in (("missing", "has no attribute"), ("mask", "Weird"), ("mask2", "Weird2")):
        with pytest.raises(UnsupportedConfigError, match=text) as err:
            resolve_hook(f"{name}:{attr}", kind="mask_mod", setting="turbo_flex_attention_mask_mod")
        assert "turbo_flex_attention_mask_mod" in err.value.settings
