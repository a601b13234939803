//! Model presets: the KV geometry of real models, so the replay moves the
//! bytes per token those models move.

use anyhow::{Result, bail};

/// KV geometry of one model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ModelPreset {
    /// Preset name.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u64,
    /// KV heads (GQA); for MLA the latent is one shared "head".
    pub kv_heads: u64,
    /// Dimensions per head (MLA: kv_lora_rank + rope dims).
    pub head_dim: u64,
    /// Bytes per element.
    pub dtype_bytes: u64,
    /// MLA: one latent per token, no separate K and V, the same on every TP
    /// shard (a `replicated` group).
    pub mla: bool,
}

/// The presets `--model` accepts.
pub(crate) const PRESETS: &[ModelPreset] = &[
    // Llama-3-8B: 32 layers, 8 KV heads × 128, bf16 → 128 KiB per token.
    ModelPreset { name: "llama3-8b", layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, mla: false },
    // Llama-3-70B: 80 layers, 8 KV heads × 128, bf16 → 320 KiB per token.
    ModelPreset { name: "llama3-70b", layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 2, mla: false },
    // Qwen3-32B: 64 layers, 8 KV heads × 128, bf16 → 256 KiB per token.
    ModelPreset { name: "qwen3-32b", layers: 64, kv_heads: 8, head_dim: 128, dtype_bytes: 2, mla: false },
    // DeepSeek-V3: 61 layers of MLA, latent 512 + rope 64, bf16 → 68.6 KiB per token.
    ModelPreset { name: "deepseek-v3", layers: 61, kv_heads: 1, head_dim: 576, dtype_bytes: 2, mla: true },
];

impl ModelPreset {
    /// Look a preset up by name.
    ///
    /// # Errors
    /// Unknown name (the message lists the known ones).
    pub(crate) fn by_name(name: &str) -> Result<Self> {
        PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name)).copied().ok_or_else(|| {
            let known: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
            anyhow::anyhow!("unknown model {name:?}; known: {}", known.join(", "))
        })
    }

    /// Bytes per token of the whole model (all layers, all shards).
    pub(crate) fn bytes_per_token(&self) -> u64 {
        self.bytes_per_token_layers(self.layers)
    }

    /// Bytes per token for `layers` layers (K and V unless MLA).
    pub(crate) fn bytes_per_token_layers(&self, layers: u64) -> u64 {
        let kv = if self.mla { 1 } else { 2 };
        kv * layers * self.kv_heads * self.head_dim * self.dtype_bytes
    }

    /// Bytes per token held by one of `tp` shards for `layers` layers: the
    /// KV heads split across shards, or the whole latent (MLA, replicated).
    ///
    /// # Errors
    /// TP that does not divide the KV heads (GQA).
    pub(crate) fn shard_bytes_per_token(&self, layers: u64, tp: u64) -> Result<u64> {
        if self.mla {
            return Ok(self.bytes_per_token_layers(layers));
        }
        if tp == 0 || !self.kv_heads.is_multiple_of(tp) {
            bail!("TP {tp} must divide the {} KV heads of {}", self.kv_heads, self.name);
        }
        Ok(self.bytes_per_token_layers(layers) / tp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_token_bytes_match_the_real_models() {
        let l8 = ModelPreset::by_name("llama3-8b").unwrap();
        assert_eq!(l8.bytes_per_token(), 128 << 10);
        assert_eq!(l8.shard_bytes_per_token(1, 2).unwrap(), 2 << 10);
        assert!(l8.shard_bytes_per_token(1, 3).is_err());
        let ds = ModelPreset::by_name("DeepSeek-V3").unwrap();
        assert_eq!(ds.bytes_per_token(), 61 * 576 * 2);
        assert_eq!(ds.shard_bytes_per_token(61, 8).unwrap(), 61 * 576 * 2);
        assert!(ModelPreset::by_name("gpt-5").is_err());
    }
}
