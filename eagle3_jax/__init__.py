"""eagle3-jax: EAGLE-3 speculative decoding for Llama-3 targets in JAX/XLA."""

from eagle3_jax.config import TreeSpec
from eagle3_jax.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "TreeSpec"]


def __getattr__(name):
    # The API pulls in JAX and transformers; import it when first used, not on `import eagle3_jax`.
    if name in ("LLM", "CompletionOutput", "Logprob", "RequestOutput"):
        from eagle3_jax import api

        return getattr(api, name)
    raise AttributeError(name)
