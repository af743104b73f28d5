"""Shared test fixtures: tiny random-weight GDN targets whose logits are far from uniform."""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator

import torch

from specla.config import GDNConfig
from specla.model import GDNForCausalLM


def random_target(vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 2,
                  head_dim: int = 16, expand_v: float = 2.0, seed: int = 0,
                  std: float = 0.5) -> GDNForCausalLM:
    torch.manual_seed(seed)
    config = GDNConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                       num_heads=heads, head_dim=head_dim, expand_v=expand_v,
                       intermediate_size=2 * hidden)
    model = GDNForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Large random weights give peaked logits (few near-ties) and fast-moving states.
            torch.nn.init.normal_(p, std=0.3 if name.endswith(("A_log", "dt_bias")) else std)
    return model


def random_inputs(B: int, N: int, H: int, K: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, N, H, K, generator=g), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, N, H, K, generator=g), dim=-1)
    v = torch.randn(B, N, H, V, generator=g)
    gate = -torch.rand(B, N, H, generator=g)
    beta = torch.rand(B, N, H, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    return q, k, v, gate, beta, S0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_runtime():
    """The embedded model when assets/ has it, else a tiny random-weight stand-in."""
    from specla import runner
    return (runner.load_runtime(device="cpu") if (runner.ASSETS / "target").exists()
            else runner.tiny_random_runtime())


@contextlib.contextmanager
def served(demo) -> Iterator[str]:
    """`demo` queued and served on a free localhost port (no SSR, as the app launches it):
    its address, until the block ends."""
    from specla import explorer
    demo.queue(default_concurrency_limit=4)
    _, address, _ = demo.launch(prevent_thread_lock=True, ssr_mode=False, server_name="127.0.0.1",
                                server_port=free_port(), quiet=True, **explorer.LAUNCH_KWARGS)
    try:
        yield address
    finally:
        demo.close()
