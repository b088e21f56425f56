// The bf16 prefill's entry points (bf16_kernels.cpp), declared for the library's ABI table (cpu_kernels.cpp).
#pragma once

#include <stdint.h>

extern "C" {

int ss_bf16_isa_ready(int isa);

int ss_bf16_linear(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t out, int64_t kp,
                   const float* bias, float* y, int64_t ldy, int threads, int isa);

int ss_bf16_attention_input(const float* x, int64_t tokens, int64_t hidden, const float* norm_weight, float eps,
                            const uint16_t* qkv_packed, const float* qkv_bias, float* qkv, const int64_t* positions,
                            const float* cos, const float* sin_signed, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, const float* q_norm, const float* k_norm, void* k_cache, void* v_cache,
                            int cache_type, const int64_t* slot_mapping, int threads, int isa);

int ss_bf16_prefill_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, int cache_type,
                              const int64_t* blocks, int64_t n, int64_t prefix, const uint16_t* own_keys,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, uint16_t* out, int64_t ldo, int threads, int isa);

int ss_bf16_output_and_mlp(float* x, int64_t tokens, int64_t hidden, const uint16_t* attn, int64_t attn_width,
                           const uint16_t* o_packed, const float* norm_weight, float eps,
                           const uint16_t* gate_up_packed, const uint16_t* down_packed, int64_t inter, int threads,
                           int isa);
}
