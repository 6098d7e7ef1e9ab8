"""The OpenAI-compatible HTTP front end of `cpuinfer serve` (vLLM's API surface)."""
