// The experts of a compiled CPU decoding step (fast.decode_experts), as one op: each token runs only the
// experts it takes (its slots with a nonzero gate), and each expert's two matmuls are split by columns over
// the threads. A step then costs the experts its tokens take, whatever their number. Inductor's kernel for
// the same static slots runs every slot, taken or not, and splits the slots over the threads, so that a
// token taking 3 or 5 experts leaves a thread idle for one expert's time (results/README.md, decoding).
// Float32, contiguous; built by fast.built_cpu_kernel with torch.utils.cpp_extension.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

constexpr int64_t TILE = 32;  // output columns a thread keeps in registers (four AVX2 vectors)

// acc[j] += sum over r of scale * v[r] * w[r * stride + j], for j < width
static inline void accumulate(float* acc, const float* v, float scale, const float* w, int64_t rows,
                              int64_t stride, int64_t width) {
  if (width == TILE) {  // a constant trip count: the compiler keeps acc in registers
    for (int64_t r = 0; r < rows; r++) {
      const float a = scale * v[r];
      const float* row = w + r * stride;
      for (int64_t j = 0; j < TILE; j++) acc[j] += a * row[j];
    }
    return;
  }
  for (int64_t r = 0; r < rows; r++) {
    const float a = scale * v[r];
    const float* row = w + r * stride;
    for (int64_t j = 0; j < width; j++) acc[j] += a * row[j];
  }
}

// x (M, C), expert and gate (M, S), w_fc (N, C, H), w_proj (N, H, C) -> y (M, C):
// y[m] = sum over s with gate[m, s] != 0 of gate[m, s] * gelu(x[m] @ w_fc[e]) @ w_proj[e], e = expert[m, s]
at::Tensor token_experts(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& gate,
                         const at::Tensor& w_fc, const at::Tensor& w_proj) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && gate.scalar_type() == at::kFloat && w_fc.scalar_type() == at::kFloat &&
                  w_proj.scalar_type() == at::kFloat,
              "token_experts: float32 only");
  const at::Tensor xc = x.contiguous(), ec = expert.contiguous(), gc = gate.contiguous();
  const at::Tensor fc = w_fc.contiguous(), proj = w_proj.contiguous();
  const int64_t M = xc.size(0), C = xc.size(1), S = ec.size(1), H = fc.size(2);
  at::Tensor h = at::empty({M, S, H}, xc.options()), y = at::empty({M, C}, xc.options());
  const float *xp = xc.data_ptr<float>(), *gp = gc.data_ptr<float>(), *fp = fc.data_ptr<float>();
  const float* pp = proj.data_ptr<float>();
  const int64_t* ep = ec.data_ptr<int64_t>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  // h[m, s] = gelu(x[m] @ w_fc[e]) for the taken slots; each thread its tiles of the H columns
  at::parallel_for(0, (H + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t j0 = t * TILE, width = std::min(TILE, H - j0);
      for (int64_t ms = 0; ms < M * S; ms++) {
        if (gp[ms] == 0.f) continue;
        float acc[TILE] = {0};
        accumulate(acc, xp + ms / S * C, 1.f, fp + ep[ms] * C * H + j0, C, H, width);
        for (int64_t j = 0; j < width; j++)
          hp[ms * H + j0 + j] = 0.5f * acc[j] * (1.f + std::erf(acc[j] * static_cast<float>(M_SQRT1_2)));
      }
    }
  });
  // y[m] = sum over the taken slots of gate[m, s] * h[m, s] @ w_proj[e]; each thread its tiles of the C columns
  at::parallel_for(0, (C + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t c0 = t * TILE, width = std::min(TILE, C - c0);
      for (int64_t m = 0; m < M; m++) {
        float acc[TILE] = {0};
        for (int64_t ms = m * S; ms < (m + 1) * S; ms++)
          if (gp[ms] != 0.f) accumulate(acc, hp + ms * H, gp[ms], pp + ep[ms] * H * C + c0, H, C, width);
        std::copy(acc, acc + width, yp + m * C + c0);
      }
    }
  });
  return y;
}

TORCH_LIBRARY(seqmoe, m) {
  m.def("token_experts(Tensor x, Tensor expert, Tensor gate, Tensor w_fc, Tensor w_proj) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqmoe, CPU, m) { m.impl("token_experts", &token_experts); }
