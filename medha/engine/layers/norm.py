import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.vllm = False  # vLLM's fused kernel (LlamaForCausalLM.use_vllm_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vllm:
            from medha.engine.layers.vllm_kernels import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 or x.is_cuda:
            # one call: on CUDA one fused kernel; on CPU in fp32 transformers' ops in its order
            # (bit for bit), without their Python. (In bf16 on CPU torch's runs 4x slower than
            # the ops below, and scales by the weight before rounding, where transformers
            # rounds first.)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # the variance in fp32 whatever the activation dtype, as transformers does
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
