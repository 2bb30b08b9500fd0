"""The parallel mechanics: data parallelism and ZeRO, tensor parallelism, pipelines."""
