"""The numbers of a model that shape its graph: read from config.json by the front end, kept in the manifest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a checkpoint that shape its graph, read once from config.json."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope_type: str
    rope_theta: float
    o_bias: bool = False  # the attention output projection's bias (Qwen2: q, k, v biased, o not)
    attention_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores (no SDPA op form)
    # mixture of experts: each layer's MLP is num_experts gated MLPs of expert_size, experts_per_token of them
    # routed to per token; 0 experts: a dense MLP of intermediate_size
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    shared_expert_size: int = 0  # an expert every token runs (Qwen2-MoE, GLM-4.5); 0: none
    expert_projections: int = 0  # an expert's weight matrices: 3 (gate, up, down) or 2 (gate and up fused, down)
    # Llama 4: the top-k router logits' sigmoids scale each chosen expert's input; with top-1 the token is scaled
    # before the tiled block the CPU plugin gathers, with more every expert runs on every token (0 where not chosen)
    expert_input_scores: bool = False
    # Llama 4: its rotary layers attend within chunks of this many positions (0: none); no PagedAttention form
    attention_chunk: int = 0
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (no SDPA op form)
    # the layers of a mixture-of-experts model whose MLP is dense, of intermediate_size (GLM-4.5's leading
    # layers, Qwen MoE's mlp_only_layers); every other layer holds the experts
    dense_layers: tuple[int, ...] = ()
    qk_norm: bool = True  # a family with q/k norms: whether this checkpoint has them (GLM-4.5's use_qk_norm)
    # multi-head latent attention (DeepSeek-V3): keys and values come from a kv_lora_rank-wide latent (0: not MLA);
    # queries from a q_lora_rank-wide one (0: one q projection); the last rope_head_dim dims of a query/key head
    # rotate (the key's shared by every head); head_dim is a key's nope + rope dims, value_head_dim a value's
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    value_head_dim: int = 0  # 0: head_dim
    # MLA's cache: True, the latent (after kv_a_layernorm) and the rotary key, one KV head shared by every query
    # head, kv_b absorbed into the query and the output (frontend/mla.py); False, every head's key and value
    latent_cache: bool = False

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def v_dim(self) -> int:
        """A value head's width: head_dim, or MLA's v_head_dim."""
        return self.value_head_dim or self.head_dim

    @property
    def cache_heads(self) -> int:
        """The KV cache's heads (its axis 1): num_kv_heads, or 1 for MLA's latent cache."""
        return 1 if self.latent_cache else self.num_kv_heads

    @property
    def cache_dims(self) -> tuple[int, int]:
        """The last axis of a layer's cached keys and values, in that order (the KV cache is [batch, cache_heads,
        positions, dim]): MLA's latent cache keys [latent; rotary key], values the latent."""
        if self.latent_cache:
            return self.kv_lora_rank + self.rope_head_dim, self.kv_lora_rank
        return self.head_dim, self.v_dim

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements a token costs one layer (keys and values of every cache head)."""
        return self.cache_heads * sum(self.cache_dims)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (not a dense layer of a MoE model)."""
        return self.moe and layer not in self.dense_layers

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads
