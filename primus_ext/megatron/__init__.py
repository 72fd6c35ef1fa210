"""Megatron-LM integration: layer facts, attention modules and spec providers."""
