// One-pass fp32 CPU kernels for two pieces of a Qwen2 / Llama / Baichuan decoder layer that PyTorch runs as a chain
// of elementwise operations, each a pass over memory (`rlhf_trl.cpu.fuse_kernels`, PPO's `fused_kernels`):
//
// SwiGLU, silu(gate) * up: PyTorch's silu then mul are five passes of the [tokens, intermediate] size forward and
// nine backward (two muls and silu_backward, which also keep silu(gate) for the backward); here three forward (read
// gate and up, write the product) and five backward (read the gradient, gate and up; write both gradients), and
// nothing kept but gate and up.
//
// RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension: PyTorch's pow, mean, add, rsqrt and two
// muls (and their backward) become one pass per row each way; the forward keeps 1 / rms per row for the backward.
// The weight's gradient is summed per thread over its rows, then over the threads in thread order: the same sums
// every run (for a fixed thread count), as exact resume needs.
//
// exp is Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, the exponent bits set
// directly): within 2 ulp of the correctly rounded value, and plain arithmetic the compiler vectorises (no libm
// call per element). So neither kernel is PyTorch's bit for bit (Sleef's exp, other summation orders): the same
// functions to fp32 rounding. A NaN input gives NaN outputs and gradients.
// Threads: OpenMP, built against PyTorch's own libgomp, so it shares PyTorch's thread pool and thread count; below
// kParallel elements (a decoding step's few rows) one thread, as PyTorch's own elementwise grain size does.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float exp_cephes(float x) {
    x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);  // the range with a normal result (NaN stays)
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // x / ln 2 to nearest (1.5 x 2^23)
    float r = x - n * 0.693359375f;  // x - n ln 2, ln 2 in two parts (Cody-Waite)
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

constexpr int64_t kParallel = 32768;  // elements: PyTorch's at::internal::GRAIN_SIZE

}  // namespace

extern "C" {

// out[i] = gate[i] * sigmoid(gate[i]) * up[i], i < n
void rlhf_trl_swiglu_forward(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallel)
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        out[i] = g / (1.0f + exp_cephes(-g)) * up[i];
    }
}

// d_up = grad * silu(gate); d_gate = grad * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
void rlhf_trl_swiglu_backward(const float* grad, const float* gate, const float* up, float* d_gate, float* d_up,
                              int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallel)
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        const float s = 1.0f / (1.0f + exp_cephes(-g));
        d_up[i] = grad[i] * g * s;
        d_gate[i] = grad[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    }
}

// rows x dim: rstd[r] = 1 / sqrt(mean(x[r]^2) + eps); y[r] = weight * (x[r] * rstd[r])
void rlhf_trl_rms_norm_forward(const float* x, const float* weight, float* y, float* rstd, int64_t rows, int64_t dim,
                               float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallel)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim;
        float* yr = y + r * dim;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; ++i) squares += xr[i] * xr[i];
        const float s = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * s);
    }
}

// dx[r] = rstd[r] * (g - xhat * mean(g * xhat)), g = dy[r] * weight, xhat = x[r] * rstd[r];
// d_weight (dim floats, or null: not wanted) = sum over rows of dy[r] * xhat
void rlhf_trl_rms_norm_backward(const float* dy, const float* x, const float* weight, const float* rstd, float* dx,
                                float* d_weight, int64_t rows, int64_t dim) {
    const int threads = rows * dim >= kParallel ? omp_get_max_threads() : 1;
    std::vector<float> partial(d_weight ? static_cast<size_t>(threads) * dim : 0, 0.0f);
#pragma omp parallel num_threads(threads)
    {
        float* mine = d_weight ? partial.data() + static_cast<size_t>(omp_get_thread_num()) * dim : nullptr;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const float* dyr = dy + r * dim;
            const float* xr = x + r * dim;
            float* dxr = dx + r * dim;
            const float s = rstd[r];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; ++i) dot += dyr[i] * weight[i] * (xr[i] * s);
            const float c = dot / static_cast<float>(dim);
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) dxr[i] = s * (dyr[i] * weight[i] - (xr[i] * s) * c);
            if (mine) {
#pragma omp simd
                for (int64_t i = 0; i < dim; ++i) mine[i] += dyr[i] * (xr[i] * s);
            }
        }
    }
    if (d_weight) {
        for (int64_t i = 0; i < dim; ++i) d_weight[i] = 0.0f;
        for (int t = 0; t < threads; ++t)
            for (int64_t i = 0; i < dim; ++i) d_weight[i] += partial[static_cast<size_t>(t) * dim + i];
    }
}

}  // extern "C"
