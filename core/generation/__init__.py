"""Generation: KV-cache decoding under tensor parallelism and the layout-invariant sampler."""
