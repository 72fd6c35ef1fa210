"""User-facing settings of the Turbo attention path (YAML keys) and their hooks.

Hook resolution (which imports torch and user modules) lives in
`primus_ext.settings.hooks` and is imported from there explicitly.
"""

from .settings import (
    BACKEND_CHOICES,
    SETTING_KEYS,
    TurboAttentionSettings,
    describe_keys,
    spec_refs,
)

__all__ = ["BACKEND_CHOICES", "SETTING_KEYS", "TurboAttentionSettings", "describe_keys", "spec_refs"]
