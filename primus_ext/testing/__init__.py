"""Test helpers for users of primus_ext, notably a CPU fake of Primus-Turbo."""

from .fake_turbo import BuildOptions, Call, FakeTurbo, entry_signatures, fake_primus_turbo

__all__ = ["BuildOptions", "Call", "FakeTurbo", "entry_signatures", "fake_primus_turbo"]
