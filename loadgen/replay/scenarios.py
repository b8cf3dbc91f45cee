"""The replay simulation's named workloads: load, prompt and output lengths, engine and network.

A ``Scenario`` is plain data: what a user picks (``tokentrace replay --scenario``) and a test
tunes, kept apart from the engine model that runs it (``simulation``). Each preset is named after
what makes its slow requests slow. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["SCENARIOS", "Scenario"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """The workload and the engine of one simulation. Times in the unit the name says."""

    name: str
    description: str
    # Load: open-loop Poisson at ``rate_per_s`` or ``concurrency`` closed-loop clients.
    rate_per_s: float | None = 4.0
    concurrency: int | None = None
    think_time_s: float = 0.0
    burst_period_s: float = 0.0
    """Every this many seconds the arrival rate is multiplied for ``burst_duration_s``; 0: no
    bursts."""
    burst_duration_s: float = 0.0
    burst_rate_factor: float = 1.0
    # Prompts (lognormal around the median, clipped).
    prompt_tokens_median: int = 384
    prompt_tokens_sigma: float = 0.6
    prompt_tokens_min: int = 16
    prompt_tokens_max: int = 4096
    long_prompt_fraction: float = 0.0
    long_prompt_tokens_median: int = 8000
    long_prompt_tokens_max: int = 16000
    shared_prefix_fraction: float = 0.3
    """Fraction of requests that start with one of ``shared_prefixes`` system prompts."""
    shared_prefix_tokens: int = 256
    shared_prefixes: int = 4
    # Outputs.
    output_tokens_median: int = 128
    output_tokens_sigma: float = 0.7
    output_tokens_min: int = 1
    max_tokens: int = 1024
    """The request's ``max_tokens``: longer outputs stop here with finish reason ``length``."""
    text_completion_fraction: float = 0.0
    # Engine.
    max_running: int = 64
    max_batched_tokens: int = 2048
    """Token budget of one engine step (chunked prefill splits prompts above it)."""
    kv_cache_tokens: int = 200_000
    step_base_ms: float = 6.0
    prefill_us_per_token: float = 30.0
    decode_us_per_running: float = 90.0
    step_jitter: float = 0.05
    """Relative standard deviation of step durations."""
    cold_start_s: float = 0.0
    """The server is ready this long after the simulation starts; earlier requests wait."""
    # HTTP layer.
    tokenize_base_ms: float = 1.0
    tokenize_us_per_token: float = 0.5
    postprocess_base_ms: float = 0.3
    postprocess_us_per_token: float = 1.0
    response_ms: float = 0.3
    # Client and network.
    client_spans: bool = True
    network_one_way_ms: float = 1.0
    network_jitter: float = 0.05
    # Request parameters.
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    temperature: float = 0.7
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ValueError(f"scenario {self.name!r}: set exactly one of rate_per_s, concurrency")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError(f"scenario {self.name!r}: rate_per_s must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"scenario {self.name!r}: concurrency must be >= 1")
        if self.max_running < 1 or self.max_batched_tokens < 1:
            raise ValueError(f"scenario {self.name!r}: max_running and max_batched_tokens >= 1")
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens >= self.prompt_tokens_max:
            raise ValueError(f"scenario {self.name!r}: shared prefix must be shorter than prompts")
        # A request that alone exceeds the KV cache could never finish (vLLM refuses it too).
        if self.kv_cache_tokens < self.longest_prompt_tokens + self.max_tokens:
            raise ValueError(
                f"scenario {self.name!r}: kv_cache_tokens must hold the longest prompt plus "
                f"max_tokens ({self.longest_prompt_tokens + self.max_tokens})"
            )

    @property
    def longest_prompt_tokens(self) -> int:
        """The largest prompt the scenario can draw."""
        if self.long_prompt_fraction > 0:
            return max(self.prompt_tokens_max, self.long_prompt_tokens_max)
        return self.prompt_tokens_max


SCENARIOS: Final[dict[str, Scenario]] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            name="steady",
            description="well within capacity: decode dominates E2E, prefill dominates TTFT",
            rate_per_s=4.0,
        ),
        Scenario(
            name="queue_saturation",
            description="arrivals far above capacity: TTFT is mostly queue wait",
            rate_per_s=60.0,
            max_running=16,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="long_prompts",
            description="prompts of ~12k tokens at a low rate: TTFT is mostly (chunked) prefill",
            rate_per_s=0.5,
            prompt_tokens_median=12_000,
            prompt_tokens_sigma=0.3,
            prompt_tokens_min=4_000,
            prompt_tokens_max=32_000,
            output_tokens_median=64,
            output_tokens_sigma=0.4,
            max_tokens=512,
            max_batched_tokens=4096,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="cold_start",
            description="traffic arrives while the server is still starting: waits on cold start",
            rate_per_s=8.0,
            cold_start_s=30.0,
        ),
        Scenario(
            name="kv_pressure",
            description="a tiny KV cache under steady load: requests are preempted and recomputed",
            rate_per_s=1.5,
            prompt_tokens_median=256,
            prompt_tokens_sigma=0.3,
            prompt_tokens_max=1024,
            output_tokens_median=768,
            output_tokens_sigma=0.3,
            max_tokens=2048,
            kv_cache_tokens=8_000,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="interference",
            description="long prompts mixed into a decode-heavy load: spiky inter-token latency",
            rate_per_s=3.0,
            prompt_tokens_median=128,
            prompt_tokens_sigma=0.4,
            prompt_tokens_max=512,
            long_prompt_fraction=0.2,
            long_prompt_tokens_median=12_000,
            long_prompt_tokens_max=24_000,
            output_tokens_median=512,
            output_tokens_sigma=0.3,
            max_tokens=2048,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="network",
            description="short requests from a distant client: the network dominates",
            rate_per_s=4.0,
            prompt_tokens_median=128,
            prompt_tokens_sigma=0.4,
            prompt_tokens_max=1024,
            output_tokens_median=24,
            output_tokens_sigma=0.4,
            max_tokens=256,
            shared_prefix_fraction=0.0,
            network_one_way_ms=120.0,
        ),
        Scenario(
            name="mixed",
            description="steady traffic with periodic bursts and a few long prompts: the median "
            "request is decode-bound while the slow tail waited in the queue",
            rate_per_s=3.0,
            burst_period_s=30.0,
            burst_duration_s=2.0,
            burst_rate_factor=8.0,
            max_running=16,
            long_prompt_fraction=0.03,
            long_prompt_tokens_median=6000,
            long_prompt_tokens_max=12000,
            shared_prefix_fraction=0.4,
            text_completion_fraction=0.2,
            network_one_way_ms=2.0,
        ),
    )
}
"""Named presets; ``mixed`` is the demo default."""
