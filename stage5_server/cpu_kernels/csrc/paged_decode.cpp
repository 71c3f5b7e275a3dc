// Decode attention on a CPU, reading K/V in place through the block tables.
//
// One query token per sequence (a decode): for each (sequence, KV head) the query heads that share
// the KV head are scored against the sequence's keys block by block, soft-maxed, and summed over the
// values, in float32 whatever the cache's dtype. Nothing is gathered or padded: a sequence reads its
// own blocks and stops at its own length. The (sequence, KV head) pairs run in parallel on ATen's
// thread pool; where there are fewer pairs than threads (one request has a few KV heads), each
// pair's blocks are split into parts that run in parallel and merge at the end.
//
// The inner loops work on 16 floats at a time (cpu_math.h's VecF): for the common head sizes (32,
// 64 and 128) the width is fixed when compiled, so a key's or a value's row, and the outputs of up
// to four query heads, stay in registers while the tokens stream past; other sizes take scalar
// loops. The exponentials are a polynomial the compiler vectorizes, not a library call per score.
//
// vLLM: csrc/cpu/attention.cpp (paged_attention_v1) behind vllm/v1/attention/backends/cpu_attn.py;
// its 16-float vector attention is csrc/cpu/cpu_attn_vec16.hpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace {

using stagedserve_cpu::exp_series;
using stagedserve_cpu::kVecWidth;
using stagedserve_cpu::load_vec;
using stagedserve_cpu::store_vec;
using stagedserve_cpu::sum_vec;
using stagedserve_cpu::VecF;

// One cache row (head_dim elements) as float32.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);  // bfloat16: float32's upper half
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    dst[i] = value;
  }
}

// Ask for a block's rows of one head (row_bytes each) before they are read: the blocks of a
// sequence lie anywhere in the pool, where the hardware's own prefetcher cannot guess them.
inline void prefetch_block(const void* block, int64_t block_size, int64_t token_bytes, int64_t row_bytes) {
  const char* base = static_cast<const char*>(block);
  for (int64_t offset = 0; offset < block_size; ++offset) {
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(base + offset * token_bytes + line);
  }
}

// fn(t, row) for each token t < len of a sequence, walking its block table block by block.
template <typename scalar_t, typename Fn>
inline void for_each_token(const scalar_t* cache, const int32_t* table, int64_t len, int64_t block_size,
                           int64_t block_stride, int64_t token_stride, int64_t row_bytes, Fn&& fn) {
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const scalar_t* block = cache + static_cast<int64_t>(table[b]) * block_stride;
    const int64_t n = std::min(block_size, len - start);
    if (start + block_size < len) {
      prefetch_block(cache + static_cast<int64_t>(table[b + 1]) * block_stride, block_size,
                     token_stride * sizeof(scalar_t), row_bytes);
    }
    for (int64_t offset = 0; offset < n; ++offset) fn(start + offset, block + offset * token_stride);
  }
}

// Parts per (decode, KV head) when there are fewer of those than threads: each part attends a
// run of the sequence's blocks, and the parts merge as flash-decoding's split-K does. A part has
// at least kMinPartTokens tokens, so a short sequence stays one part.
constexpr int64_t kMinPartTokens = 64;
constexpr int64_t kMaxHeadDim = 512;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// acc [kHeads, kChunks * kVecWidth] = the sum over the part's n tokens of weights[h, t] * value_t
// (weights: kHeads rows of n), with the kHeads x kChunks accumulators in registers and each value
// row loaded once for all of them (a loop of its own: a lambda's by-reference capture would keep
// the accumulators in memory).
template <int64_t kChunks, int64_t kHeads, typename scalar_t>
void weigh_values(const scalar_t* v_head, const int32_t* table, int64_t n, int64_t block_size, int64_t block_stride,
                  int64_t token_stride, const float* weights, float* acc) {
  VecF sums[kHeads][kChunks] = {};
  for (int64_t start = 0, b = 0; start < n; start += block_size, ++b) {
    const scalar_t* block = v_head + static_cast<int64_t>(table[b]) * block_stride;
    const int64_t count = std::min(block_size, n - start);
    if (start + block_size < n) {
      prefetch_block(v_head + static_cast<int64_t>(table[b + 1]) * block_stride, block_size,
                     token_stride * sizeof(scalar_t), kChunks * kVecWidth * sizeof(scalar_t));
    }
    for (int64_t offset = 0; offset < count; ++offset) {
      const scalar_t* value = block + offset * token_stride;
      for (int64_t c = 0; c < kChunks; ++c) {
        const VecF row = load_vec(value + c * kVecWidth);
        for (int64_t h = 0; h < kHeads; ++h) sums[h][c] += weights[h * n + start + offset] * row;
      }
    }
  }
  for (int64_t h = 0; h < kHeads; ++h) {
    for (int64_t c = 0; c < kChunks; ++c) store_vec(acc + (h * kChunks + c) * kVecWidth, sums[h][c]);
  }
}

// One part of one (decode, KV head): each query head of the group (qf, pre-scaled, [group, D])
// against the part's n keys, exp(score - max) per head, and the values weighted by it: writes the
// heads' max, their sums of exp and their unnormalized outputs acc [group, D]. kChunks is D in
// VecF widths, fixed when compiled for the common head sizes so that a key's or a value's chunks
// stay in registers; 0 takes any D through scalar loops (row_f: one row as float32).
template <int64_t kChunks, typename scalar_t>
void attend_part(const float* qf, int64_t group, int64_t head_dim, const scalar_t* k_head, const scalar_t* v_head,
                 const int32_t* table, int64_t n, int64_t block_size, int64_t block_stride, int64_t token_stride,
                 float* scores, float* row_f, float* max, float* sum, float* acc) {
  const int64_t row_bytes = head_dim * sizeof(scalar_t);
  if constexpr (kChunks > 0) {
    for_each_token(k_head, table, n, block_size, block_stride, token_stride, row_bytes,
                   [&](int64_t t, const scalar_t* key) {
      VecF row[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) row[c] = load_vec(key + c * kVecWidth);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * head_dim;
        VecF dot = row[0] * load_vec(qg);
        for (int64_t c = 1; c < kChunks; ++c) dot += row[c] * load_vec(qg + c * kVecWidth);
        scores[g * n + t] = sum_vec(dot);
      }
    });
  } else {
    for_each_token(k_head, table, n, block_size, block_stride, token_stride, row_bytes,
                   [&](int64_t t, const scalar_t* key) {
      to_float(key, row_f, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row_f[d];
        scores[g * n + t] = dot;
      }
    });
  }
  for (int64_t g = 0; g < group; ++g) {  // exp(score - max) over the part's keys, per query head
    float* s = scores + g * n;
    const float top = *std::max_element(s, s + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_series(s[t] - top);
      total += s[t];
    }
    max[g] = top;
    sum[g] = total;
  }
  if constexpr (kChunks > 0) {
    // A few query heads at a time, their accumulators in registers (kChunks each).
    constexpr int64_t kHeads = kChunks <= 4 ? 4 : 2;
    for (int64_t g = 0; g < group; g += kHeads) {
      float* head_acc = acc + g * head_dim;
      const float* weights = scores + g * n;
      switch (std::min(kHeads, group - g)) {
        case 1: weigh_values<kChunks, 1>(v_head, table, n, block_size, block_stride, token_stride, weights, head_acc);
          break;
        case 2: weigh_values<kChunks, 2>(v_head, table, n, block_size, block_stride, token_stride, weights, head_acc);
          break;
        case 3: weigh_values<kChunks, 3>(v_head, table, n, block_size, block_stride, token_stride, weights, head_acc);
          break;
        default: weigh_values<kChunks, kHeads>(v_head, table, n, block_size, block_stride, token_stride, weights,
                                              head_acc);
      }
    }
  } else {
    std::fill(acc, acc + group * head_dim, 0.f);
    for_each_token(v_head, table, n, block_size, block_stride, token_stride, row_bytes,
                   [&](int64_t t, const scalar_t* value) {
      to_float(value, row_f, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n + t];
        float* a = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row_f[d];
      }
    });
  }
}

// attend_part for this head size: a compiled width where there is one, else scalar loops.
template <typename scalar_t>
void attend_part_any(int64_t head_dim, const float* qf, int64_t group, const scalar_t* k_head,
                     const scalar_t* v_head, const int32_t* table, int64_t n, int64_t block_size,
                     int64_t block_stride, int64_t token_stride, float* scores, float* row_f, float* max,
                     float* sum, float* acc) {
  switch (head_dim) {
#define STAGEDSERVE_ATTEND(width)                                                                              \
  case width * kVecWidth:                                                                                      \
    return attend_part<width>(qf, group, head_dim, k_head, v_head, table, n, block_size, block_stride,         \
                              token_stride, scores, row_f, max, sum, acc);
    STAGEDSERVE_ATTEND(2)
    STAGEDSERVE_ATTEND(4)
    STAGEDSERVE_ATTEND(8)
#undef STAGEDSERVE_ATTEND
    default:
      return attend_part<0>(qf, group, head_dim, k_head, v_head, table, n, block_size, block_stride, token_stride,
                            scores, row_f, max, sum, acc);
  }
}

// seqs/rows: decode i is sequence seqs[i] at query row rows[i]; null: sequence i at row i.
template <typename scalar_t>
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const int64_t* seqs, const int64_t* rows,
                      int64_t num_decodes, double scale) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t table_row = block_tables.stride(0);

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float scale_f = static_cast<float>(scale);

  TORCH_CHECK(head_dim <= kMaxHeadDim, "decode attention: head_dim up to ", kMaxHeadDim);
  const int64_t items = num_decodes * num_kv_heads;
  int64_t longest = 1;
  for (int64_t i = 0; i < num_decodes; ++i) longest = std::max<int64_t>(longest, lens[seqs ? seqs[i] : i]);
  int64_t num_parts = 1;
  const int64_t threads = at::get_num_threads();
  if (items < 2 * threads) {
    num_parts = std::min(ceil_div(2 * threads, items), std::max<int64_t>(1, longest / kMinPartTokens));
  }
  // Per (item, part) and query head of the group: the part's max score, its sum of
  // exp(score - max), and its values weighted by exp(score - max); a sum of 0 marks an empty part.
  const int64_t part_floats = group * (head_dim + 2);
  std::vector<float> parts(items * num_parts * part_floats);

  at::parallel_for(0, items * num_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row_f(head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t item = work / num_parts, part = work % num_parts;
      const int64_t i = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq = seqs ? seqs[i] : i, len = lens[seq], row = rows ? rows[i] : i;
      float* max = parts.data() + work * part_floats;
      float* sum = max + group;
      float* acc = sum + group;
      const int64_t num_blocks = ceil_div(len, block_size), per_part = ceil_div(num_blocks, num_parts);
      const int64_t first_block = part * per_part;
      const int64_t first = first_block * block_size, n = std::min(len, (first_block + per_part) * block_size) - first;
      if (n <= 0) {
        std::fill(max, max + part_floats, 0.f);
        continue;
      }
      const int32_t* table = tables + seq * table_row + first_block;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* q_head_row = q + row * q_row + (kv_head * group + g) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(q_head_row[d]) * scale_f;
      }
      scores.resize(group * n);
      attend_part_any(head_dim, qf.data(), group, k + kv_head * head_dim, v + kv_head * head_dim, table, n,
                      block_size, block_stride, token_stride, scores.data(), row_f.data(), max, sum, acc);
    }
  });

  // Merge each item's parts: rescale each to the largest max, then divide by the summed weights.
  for (int64_t item = 0; item < items; ++item) {
    const int64_t i = item / num_kv_heads, kv_head = item % num_kv_heads, row = rows ? rows[i] : i;
    const float* first = parts.data() + item * num_parts * part_floats;
    for (int64_t g = 0; g < group; ++g) {
      float top = 0.f;
      bool any = false;
      for (int64_t c = 0; c < num_parts; ++c) {
        const float* part = first + c * part_floats;
        if (part[group + g] > 0.f) {
          top = any ? std::max(top, part[g]) : part[g];
          any = true;
        }
      }
      float total = 0.f;
      float merged[kMaxHeadDim];
      std::fill(merged, merged + head_dim, 0.f);
      for (int64_t c = 0; c < num_parts; ++c) {
        const float* part = first + c * part_floats;
        if (part[group + g] <= 0.f) continue;
        const float weight = std::exp(part[g] - top);
        total += weight * part[group + g];
        const float* acc = part + 2 * group + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * acc[d];
      }
      scalar_t* o_head_row = o + row * o_row + (kv_head * group + g) * o_head;
      const float inv = 1.f / total;
      for (int64_t d = 0; d < head_dim; ++d) o_head_row[d] = static_cast<scalar_t>(merged[d] * inv);
    }
  }
}

// What both operators need of the query, the caches and the metadata; `op` names the caller.
void check_attention_inputs(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, op, ": query [T, H, D], caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && seq_lens.is_contiguous(),
              op, ": contiguous caches and seq_lens");
  TORCH_CHECK(query.stride(2) == 1 && block_tables.stride(1) == 1,
              op, ": query and block_tables contiguous in their last dimension");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && query.size(2) == key_cache.size(3),
              op, ": mismatched shapes");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              op, ": query and caches share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, op, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              op, ": block_tables and seq_lens int32");
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& seq_index,
                            const at::Tensor& query_rows, double scale) {
  check_attention_inputs("paged_decode_attention", query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(seq_index.is_contiguous() && query_rows.is_contiguous() && out.stride(2) == 1,
              "paged_decode_attention: contiguous index tensors and out rows");
  TORCH_CHECK(out.sizes() == query.sizes() && seq_index.sizes() == query_rows.sizes(),
              "paged_decode_attention: mismatched shapes");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_decode_attention: query, cache and out share a dtype");
  TORCH_CHECK(seq_index.scalar_type() == at::kLong && query_rows.scalar_type() == at::kLong,
              "paged_decode_attention: seq_index and query_rows int64");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens,
                               seq_index.data_ptr<int64_t>(), query_rows.data_ptr<int64_t>(), seq_index.size(0),
                               scale);
  });
}

// A decode-only step's attention for one layer, as one operator a compiled graph can hold: write
// each row's K/V to its slot (a negative slot is padding: not written), then attend row i over
// sequence i. The caches are declared mutated; the output is new.
at::Tensor decode_step_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_attention_inputs("decode_step_attention", query, key_cache, value_cache, block_tables, seq_lens);
  const int64_t num_tokens = query.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) == num_tokens && value.sizes() == key.sizes() &&
                  key.size(1) == num_kv_heads && key.size(2) == head_dim,
              "decode_step_attention: key and value [T, Hkv, D] matching the caches");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "decode_step_attention: key, value and caches share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "decode_step_attention: key and value rows contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == num_tokens && seq_lens.size(0) == num_tokens &&
                  block_tables.size(0) == num_tokens,
              "decode_step_attention: one int64 slot, one seq_len and one block-table row per query row");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t row_bytes = head_dim * key_cache.element_size();
  auto* k_base = static_cast<char*>(key_cache.data_ptr());
  auto* v_base = static_cast<char*>(value_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t item = key.element_size();
  for (int64_t i = 0; i < num_tokens; ++i) {  // every slot checked before any is written
    TORCH_CHECK(slots[i] < num_slots, "decode_step_attention: slot ", slots[i], " past the cache");
  }
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (slots[i] < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t offset = (slots[i] * num_kv_heads + h) * row_bytes;
      std::memcpy(k_base + offset, k_src + (i * key.stride(0) + h * key.stride(1)) * item, row_bytes);
      std::memcpy(v_base + offset, v_src + (i * value.stride(0) + h * value.stride(1)) * item, row_bytes);
    }
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_step_attention", [&] {
    decode_attention<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, nullptr, nullptr,
                               num_tokens, scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(stagedserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor seq_index, Tensor query_rows, float scale) -> ()");
  m.def(
      "decode_step_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_step_attention", &decode_step_attention);
}
