"""The names params.yaml may use for attention providers and the kernel manager's backends, without importing
what runs them (the studies' schemas, ``experiments/*/schema.py``, check params against these;
``attention.providers`` and ``attention.backends`` check at import that their registries carry exactly these
names)."""

ATTENTION_PROVIDERS = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "standard", "flex",
                       "xformers_cutlass", "xformers_splitk", "flash_attn")
BACKENDS = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa", "sdpa_math", "flex", "xformers",
            "chunked", "math")


def check_registry(registry, names: tuple[str, ...], what: str) -> None:
    if tuple(registry) != names:
        raise RuntimeError(f"{what} registry {tuple(registry)} differs from adaattn.names ({names}): change both")
