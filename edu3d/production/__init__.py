"""The bridge to production libraries: the same layouts on PyTorch's own parallel APIs
(``edu3d train --impl torch``), Hugging Face Accelerate and DeepSpeed."""
