// CUDA twin of kernels/detreduce.c (see that file and hpc_elastic/est/detsum.py for the method).
// Every floating-point step is an explicit IEEE operation (__fmul_rn, __fadd_rn, __fdiv_rn,
// __ll2float_rn) or integer arithmetic, so the results equal the CPU kernels bit for bit.
// Built lazily by hpc_elastic/est/gpu.py with --fmad=false -ftz=false -prec-div=true.
// tests/unit/kernels/test_cuda_build.py compiles it to PTX with nvcc (no GPU needed) and checks that every float
// operation is unfused, round-to-nearest, without flush to zero; the CUDA tests of tests/unit/kernels and
// tests/unit/est compare its results with the CPU kernels' bits on a GPU (run on an H200: all equal).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace {

constexpr int NONFINITE_TOP = 255;
constexpr int EXP_BIAS = 127;
constexpr int LANES = 8;

__device__ __forceinline__ int bin_of(float x, int width) {
  uint32_t bits = __float_as_uint(x);
  int e = (int)((bits >> 23) & 0xffu);
  return e == 0xff ? NONFINITE_TOP : (e + 1) / width;
}

// |trunc(x * 2^-low)| from the fp32 fields with integer shifts (trunc_scaled() in detreduce.c: the same integer).
__device__ __forceinline__ unsigned long long magnitude(float x, int low) {
  uint32_t bits = __float_as_uint(x);
  uint32_t e = (bits >> 23) & 0xffu;
  unsigned long long m = (unsigned long long)(bits & 0x7fffffu) | (e ? 0x800000ull : 0ull);
  int s = (int)(e ? e : 1u) - 150 - low;
  return s >= 0 ? (m << (s & 63)) : (s > -64 ? (m >> ((-s) & 63)) : 0ull);
}

__device__ __forceinline__ long long trunc_scaled(float x, int low) {
  long long neg = -(long long)(__float_as_uint(x) >> 31);
  return ((long long)magnitude(x, low) ^ neg) - neg;
}

// trunc(x * 2^-low) split into (hi, lo) = (trunc(T / 2^width), T - hi * 2^width), both with T's sign.
__device__ __forceinline__ void split(float x, int low, int width, long long* q, long long* r) {
  unsigned long long mag = magnitude(x, low);
  long long qq = (long long)(mag >> width);
  long long rr = (long long)(mag & ((1ull << width) - 1ull));
  long long neg = -(long long)(__float_as_uint(x) >> 31);
  *q = (qq ^ neg) - neg;
  *r = (rr ^ neg) - neg;
}

// The top bin of chunk c of x, over the block (every thread gets it).
__device__ __forceinline__ int block_top(const float* x, long long s, long long len, int width, int* s_top) {
  if (threadIdx.x == 0) *s_top = 0;
  __syncthreads();
  int tn = 0;
  for (long long i = threadIdx.x; i < len; i += blockDim.x) tn = max(tn, bin_of(x[s + i], width));
  atomicMax(s_top, tn);
  __syncthreads();
  return *s_top;
}

// 2^e as a float, for e in [-126, 127] (exactly ldexpf(1.0f, e))
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((e + 127) << 23); }

// One block per chunk.
__global__ void deposit_kernel(float* grad, long long* hi, long long* lo, uint8_t* tops, long long n, long long chunk,
                               int width, bool first, bool clear) {
  __shared__ int s_top;
  const long long c = blockIdx.x;
  const long long s = c * chunk;
  const long long len = (s + chunk <= n) ? chunk : n - s;
  const int s_old = tops[c];
  int tn = block_top(grad, s, len, width, &s_top);
  int ta;
  int shift = 0;  // 0: none, 1: promote hi to lo, 2: zero both
  if (first) {
    ta = tn;
    if (ta == NONFINITE_TOP) shift = 2;
  } else {
    ta = s_old;
    if (ta != NONFINITE_TOP && tn == NONFINITE_TOP) {
      ta = NONFINITE_TOP;
    } else if (ta != NONFINITE_TOP && tn > ta) {
      shift = (tn - ta == 1) ? 1 : 2;
      ta = tn;
    }
  }
  const int low = (ta - 1) * width - EXP_BIAS;
  for (long long i = threadIdx.x; i < len; i += blockDim.x) {
    const long long k = s + i;
    long long h = hi[k], l = lo[k];
    if (shift == 1) {
      l = h;
      h = 0;
    } else if (shift == 2) {
      h = 0;
      l = 0;
    }
    if (ta != NONFINITE_TOP) {
      long long q, r;
      split(grad[k], low, width, &q, &r);
      if (first) {
        h = q;
        l = r;
      } else {
        h += q;
        l += r;
      }
    }
    hi[k] = h;
    lo[k] = l;
    if (clear) grad[k] = 0.0f;
  }
  if (threadIdx.x == 0) tops[c] = (uint8_t)ta;
}

__global__ void combine_kernel(long long* hi, const long long* lo, const uint8_t* ltops, const uint8_t* gtops,
                               long long n, long long chunk, int width) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long c = i / chunk;
  int g = gtops[c], l = ltops[c];
  if (g == NONFINITE_TOP || g - l >= 2) {
    hi[i] = 0;
  } else if (g == l) {
    hi[i] = hi[i] * (1LL << width) + lo[i];
  }
}

// One block per chunk.
__global__ void tops_kernel(const float* grad, uint8_t* tops, long long n, long long chunk, int width) {
  __shared__ int s_top;
  const long long s = (long long)blockIdx.x * chunk;
  const long long len = (s + chunk <= n) ? chunk : n - s;
  int tn = block_top(grad, s, len, width, &s_top);
  if (threadIdx.x == 0) tops[blockIdx.x] = (uint8_t)tn;
}

// One block per chunk: hi = (the bins on the global window, as combine_kernel) + trunc(grad * 2^-L).  *bad is set
// when the global top bin lies below this process's (not a MAX).
__global__ void fold_kernel(const float* grad, long long* hi, const long long* lo, const uint8_t* btops,
                            const uint8_t* gtops, long long n, long long chunk, int width, bool have_bins, int* bad) {
  __shared__ int s_top;
  const long long c = blockIdx.x;
  const long long s = c * chunk;
  const long long len = (s + chunk <= n) ? chunk : n - s;
  const int g = gtops[c];
  const int tn = block_top(grad, s, len, width, &s_top);
  if (g != NONFINITE_TOP && (tn > g || (have_bins && btops[c] > g))) {
    if (threadIdx.x == 0) atomicExch(bad, 1);
    return;
  }
  const int rise = have_bins ? g - (int)btops[c] : 2;
  const int low = (g - 1) * width - EXP_BIAS;
  for (long long i = threadIdx.x; i < len; i += blockDim.x) {
    const long long k = s + i;
    if (g == NONFINITE_TOP) {
      hi[k] = 0;
      continue;
    }
    long long base = rise == 0 ? hi[k] * (1LL << width) + lo[k] : (rise == 1 ? hi[k] : 0);
    hi[k] = base + trunc_scaled(grad[k], low);
  }
}

__global__ void finalize_kernel(const long long* v, const uint8_t* gtops, float* out, long long n, long long chunk,
                                int width, float divisor) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int g = gtops[i / chunk];
  if (g == NONFINITE_TOP) {
    out[i] = __int_as_float(0x7fc00000);
    return;
  }
  int L = (g - 1) * width - EXP_BIAS;
  float s1, s2;
  if (L >= -126) {
    s1 = pow2f(L);
    s2 = 1.0f;
  } else {
    s1 = pow2f(-64);
    s2 = pow2f(L + 64);
  }
  float f = __ll2float_rn(v[i]);
  f = __fmul_rn(f, s1);
  f = __fmul_rn(f, s2);
  if (divisor != 1.0f) f = __fdiv_rn(f, divisor);
  out[i] = f;
}

// The definition's tree over the eight lanes of an output held by eight neighbouring threads of a warp (lane =
// thread mod 8), every thread of the warp taking part: three xor-shuffles; IEEE addition is commutative, so lane 1's
// l1 + l0 has the bits of l0 + l1 and every lane ends with ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
__device__ __forceinline__ float lane_tree(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));  // l0 + l1, l2 + l3, ...
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));  // (l0 + l1) + (l2 + l3), ...
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
}

// The fixed-order product a @ b.T (matmul_nt in detreduce.c): output (i, j) has eight lanes, lane l accumulating
// acc = fma(a[i,k], b[j,k], acc) for k = l mod 8 in increasing k from +0 (one rounding: __fmaf_rn, written out; the
// build's --fmad=false only forbids the compiler's own contraction), then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
// Tiled: a block of MM_THREADS computes an MM_BM x MM_BN tile of outputs.  The eight lanes of one output live in
// eight neighbouring threads (lane = thread mod 8), each thread holding its lane of MM_TM x MM_TN outputs; k is
// walked in increasing tiles of MM_BK (a multiple of 8) staged in shared memory, so each lane still sees its k in
// increasing order.  Past k the operands are padded with a = +0, b = -0: the lane adds the exact product -0, and
// x + (-0) = x for every x (the C kernel's padded tail).  The final tree is lane_tree.
constexpr int MM_BM = 32, MM_BN = 32, MM_BK = 32, MM_TM = 4, MM_TN = 4;
constexpr int MM_GN = MM_BN / MM_TN;                   // output groups across a tile's columns
constexpr int MM_THREADS = LANES * (MM_BM / MM_TM) * MM_GN;  // 512
constexpr int MM_LD = MM_BK + 2;  // row stride in shared memory: a warp's four column groups read distinct banks

__global__ void __launch_bounds__(MM_THREADS) matmul_nt_kernel(const float* a, const float* b, float* out, long long m,
                                                               long long n, long long k) {
  __shared__ float as[MM_BM * MM_LD];
  __shared__ float bs[MM_BN * MM_LD];
  const int tid = threadIdx.x, lane = tid % LANES, group = tid / LANES;
  const int gm = group / MM_GN, gn = group % MM_GN;
  const long long row0 = (long long)blockIdx.x * MM_BM, col0 = (long long)blockIdx.y * MM_BN;
  // a batch of products: entry z's operands and output follow entry z - 1's
  a += (long long)blockIdx.z * m * k;
  b += (long long)blockIdx.z * n * k;
  out += (long long)blockIdx.z * m * n;
  float acc[MM_TM][MM_TN];
#pragma unroll
  for (int r = 0; r < MM_TM; ++r)
#pragma unroll
    for (int c = 0; c < MM_TN; ++c) acc[r][c] = 0.0f;
  for (long long k0 = 0; k0 < k; k0 += MM_BK) {
    for (int e = tid; e < MM_BM * MM_BK; e += MM_THREADS) {
      const int r = e / MM_BK, kc = e % MM_BK;
      const long long i = row0 + r, kk = k0 + kc;
      as[r * MM_LD + kc] = (i < m && kk < k) ? a[i * k + kk] : 0.0f;
    }
    for (int e = tid; e < MM_BN * MM_BK; e += MM_THREADS) {
      const int r = e / MM_BK, kc = e % MM_BK;
      const long long j = col0 + r, kk = k0 + kc;
      bs[r * MM_LD + kc] = (j < n && kk < k) ? b[j * k + kk] : -0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < MM_BK / LANES; ++s) {
      const int kc = s * LANES + lane;
      float av[MM_TM], bv[MM_TN];
#pragma unroll
      for (int r = 0; r < MM_TM; ++r) av[r] = as[(gm * MM_TM + r) * MM_LD + kc];
#pragma unroll
      for (int c = 0; c < MM_TN; ++c) bv[c] = bs[(gn * MM_TN + c) * MM_LD + kc];
#pragma unroll
      for (int r = 0; r < MM_TM; ++r)
#pragma unroll
        for (int c = 0; c < MM_TN; ++c) acc[r][c] = __fmaf_rn(av[r], bv[c], acc[r][c]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < MM_TM; ++r) {
#pragma unroll
    for (int c = 0; c < MM_TN; ++c) {
      const float v = lane_tree(acc[r][c]);
      const long long i = row0 + gm * MM_TM + r, j = col0 + gn * MM_TN + c;
      if ((r * MM_TN + c) % LANES == lane && i < m && j < n) out[i * n + j] = v;
    }
  }
}

// The same product with one thread per lane of one output (a block: MM_LANE_OUTPUTS outputs x 8 lanes), the
// operands read from global memory (an output's eight lanes read eight neighbouring floats).  Each lane's k / 8
// dependent steps are a chain that no order-keeping split can shorten, so a product with few outputs and a long k
// (a convolution's weight gradient: [16 x 32768] @ [144 x 32768].T makes 5 tiles of 32 x 32) is bound by how
// many chains run at once: here 8 per output instead of 8 per 16 outputs, on many more multiprocessors.  Lanes
// past k take no step (the padded tail's -0 adds nothing); the final tree is the tiled kernel's.
constexpr int MM_LANE_OUTPUTS = 32;
constexpr long long MM_LANE_OUTPUTS_PER_SM = 400;

__global__ void __launch_bounds__(MM_LANE_OUTPUTS* LANES)
    matmul_nt_lanes_kernel(const float* a, const float* b, float* out, long long m, long long n, long long k) {
  const int lane = threadIdx.x % LANES;
  const long long o = (long long)blockIdx.x * MM_LANE_OUTPUTS + threadIdx.x / LANES;
  const bool live = o < m * n;
  a += (long long)blockIdx.y * m * k;  // entry y of a batch of products
  b += (long long)blockIdx.y * n * k;
  out += (long long)blockIdx.y * m * n;
  const float* ar = a + (live ? o / n : 0) * k;
  const float* br = b + (live ? o % n : 0) * k;
  float v = 0.0f;
  if (live)
    for (long long kk = lane; kk < k; kk += LANES) v = __fmaf_rn(ar[kk], br[kk], v);
  v = lane_tree(v);
  if (live && lane == 0) out[o] = v;
}

void check(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
}

long long nchunks(long long n, long long chunk) { return (n + chunk - 1) / chunk; }

// threads of a one-block-per-chunk kernel: the chunk rounded up to whole warps, 256 at most
int threads_for(long long chunk) { return chunk >= 256 ? 256 : (int)(((chunk + 31) / 32) * 32); }

void deposit(torch::Tensor grad, torch::Tensor hi, torch::Tensor lo, torch::Tensor tops, int64_t chunk, int64_t width,
             bool first, bool clear) {
  check(grad, at::kFloat, "grad");
  check(hi, at::kLong, "hi");
  check(lo, at::kLong, "lo");
  check(tops, at::kByte, "tops");
  TORCH_CHECK(chunk >= 1 && width >= 8 && width <= 31, "bad chunk/width");
  const long long n = grad.numel();
  TORCH_CHECK(hi.numel() == n && lo.numel() == n && tops.numel() == nchunks(n, chunk), "size mismatch");
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  deposit_kernel<<<(unsigned)nchunks(n, chunk), threads_for(chunk), 0, stream>>>(
      grad.data_ptr<float>(), (long long*)hi.data_ptr<int64_t>(), (long long*)lo.data_ptr<int64_t>(),
      tops.data_ptr<uint8_t>(), n, chunk, (int)width, first, clear);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void combine(torch::Tensor hi, torch::Tensor lo, torch::Tensor ltops, torch::Tensor gtops, int64_t chunk,
             int64_t width) {
  check(hi, at::kLong, "hi");
  check(lo, at::kLong, "lo");
  check(ltops, at::kByte, "local_tops");
  check(gtops, at::kByte, "global_tops");
  const long long n = hi.numel();
  TORCH_CHECK(lo.numel() == n && ltops.numel() == nchunks(n, chunk) && gtops.numel() == nchunks(n, chunk),
              "size mismatch");
  TORCH_CHECK(!(ltops.gt(gtops).logical_and(gtops.ne(NONFINITE_TOP))).any().item<bool>(),
              "global top bins must be the MAX of the local ones");
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  combine_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
      (long long*)hi.data_ptr<int64_t>(), (const long long*)lo.data_ptr<int64_t>(), ltops.data_ptr<uint8_t>(),
      gtops.data_ptr<uint8_t>(), n, chunk, (int)width);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tops(torch::Tensor grad, torch::Tensor tops, int64_t chunk, int64_t width) {
  check(grad, at::kFloat, "grad");
  check(tops, at::kByte, "tops");
  TORCH_CHECK(chunk >= 1 && width >= 8 && width <= 31, "bad chunk/width");
  const long long n = grad.numel();
  TORCH_CHECK(tops.numel() == nchunks(n, chunk), "size mismatch");
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  tops_kernel<<<(unsigned)nchunks(n, chunk), threads_for(chunk), 0, stream>>>(grad.data_ptr<float>(),
                                                                               tops.data_ptr<uint8_t>(), n, chunk,
                                                                               (int)width);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fold(torch::Tensor grad, torch::Tensor hi, torch::Tensor lo, torch::Tensor btops, torch::Tensor gtops,
          int64_t chunk, int64_t width, bool have_bins) {
  check(grad, at::kFloat, "grad");
  check(hi, at::kLong, "hi");
  check(lo, at::kLong, "lo");
  check(btops, at::kByte, "bin_tops");
  check(gtops, at::kByte, "global_tops");
  TORCH_CHECK(chunk >= 1 && width >= 8 && width <= 31, "bad chunk/width");
  const long long n = grad.numel();
  TORCH_CHECK(hi.numel() == n && lo.numel() == n && btops.numel() == nchunks(n, chunk) &&
                  gtops.numel() == nchunks(n, chunk),
              "size mismatch");
  if (n == 0) return;
  auto bad = torch::zeros({1}, grad.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  fold_kernel<<<(unsigned)nchunks(n, chunk), threads_for(chunk), 0, stream>>>(
      grad.data_ptr<float>(), (long long*)hi.data_ptr<int64_t>(), (const long long*)lo.data_ptr<int64_t>(),
      btops.data_ptr<uint8_t>(), gtops.data_ptr<uint8_t>(), n, chunk, (int)width, have_bins, bad.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(bad.item<int>() == 0, "global top bins must be the MAX of this process's");
}

void finalize(torch::Tensor v, torch::Tensor gtops, torch::Tensor out, int64_t chunk, int64_t width, double divisor) {
  check(v, at::kLong, "v");
  check(gtops, at::kByte, "global_tops");
  check(out, at::kFloat, "out");
  const long long n = v.numel();
  TORCH_CHECK(out.numel() == n && gtops.numel() == nchunks(n, chunk), "size mismatch");
  TORCH_CHECK(divisor > 0, "divisor must be positive");
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  finalize_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
      (const long long*)v.data_ptr<int64_t>(), gtops.data_ptr<uint8_t>(), out.data_ptr<float>(), n, chunk,
      (int)width, (float)divisor);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The device's multiprocessors, asked once per device (the first, eager call; not again while a CUDA graph is
// captured, and not on every product).
int sm_count(const torch::Tensor& t) {
  static std::mutex lock;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> hold(lock);
  const int device = t.get_device();
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  known[device] = sms;
  return sms;
}

// `batch` products of contiguous [batch, m, k] and [batch, n, k] operands into [batch, m, n]: one launch per 65535
// entries (the grid's limit in y and z).
void launch_products(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out, long long batch, long long m,
                     long long n, long long k, const std::string& kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "tiled" || kernel == "lanes", "kernel must be auto, tiled or lanes, got ",
              kernel);
  if (batch * m * n == 0) return;
  const long long tiles_m = (m + MM_BM - 1) / MM_BM, tiles_n = (n + MM_BN - 1) / MM_BN;
  const long long blocks = (m * n + MM_LANE_OUTPUTS - 1) / MM_LANE_OUTPUTS;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool tiled =
      kernel == "tiled" || (kernel == "auto" && batch * m * n >= MM_LANE_OUTPUTS_PER_SM * sm_count(a));
  TORCH_CHECK(tiled ? tiles_m < (1ll << 31) && tiles_n <= 65535 : blocks < (1ll << 31),
              "matmul_nt: too many outputs for one launch");
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (long long first = 0; first < batch; first += 65535) {
    const unsigned entries = (unsigned)std::min(batch - first, 65535ll);
    const float* ea = pa + first * m * k;
    const float* eb = pb + first * n * k;
    float* eo = po + first * m * n;
    if (tiled)
      matmul_nt_kernel<<<dim3((unsigned)tiles_m, (unsigned)tiles_n, entries), MM_THREADS, 0, stream>>>(ea, eb, eo, m,
                                                                                                       n, k);
    else
      matmul_nt_lanes_kernel<<<dim3((unsigned)blocks, entries), MM_LANE_OUTPUTS * LANES, 0, stream>>>(ea, eb, eo, m, n,
                                                                                                       k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// kernel: "tiled", "lanes" or "auto" (tests force each: both give the definition's bits).  "auto" takes the lanes
// below MM_LANE_OUTPUTS_PER_SM outputs per multiprocessor: a tiled product below that is one wave of blocks whose
// time grows with k alone, the lanes' with m * n * k.  Measured on an H200 (132 SMs) over the 77 product shapes of
// D2 steps of resnet_like and vgg_like at batch 32 and 128 (each shape timed with both kernels), this picks the
// faster kernel for every shape, or one within 3.5 us of it (shapes near the 20-30 us of a timed launch): 16.3 ms
// for the four steps' 148 products, against 68.0 ms tiled alone and 21.3 ms lanes alone.
torch::Tensor matmul_nt(torch::Tensor a, torch::Tensor b, const std::string& kernel) {
  check(a, at::kFloat, "a");
  check(b, at::kFloat, "b");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "shapes do not fit a @ b.T");
  const long long m = a.size(0), n = b.size(0), k = a.size(1);
  auto out = torch::empty({m, n}, a.options());
  launch_products(a, b, out, 1, m, n, k, kernel);
  return out;
}

// a[i] @ b[i].T for every i of [B, m, k] and [B, n, k]: each entry the product above, all in one launch.
torch::Tensor bmm_nt(torch::Tensor a, torch::Tensor b, const std::string& kernel) {
  check(a, at::kFloat, "a");
  check(b, at::kFloat, "b");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(2),
              "shapes do not fit a[i] @ b[i].T");
  const long long batch = a.size(0), m = a.size(1), n = b.size(1), k = a.size(2);
  auto out = torch::empty({batch, m, n}, a.options());
  launch_products(a, b, out, batch, m, n, k, kernel);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // argument names as hpc_elastic.est.detsum.Kernels, so the reducer calls both twins the same way
  m.def("deposit", &deposit, py::arg("grad"), py::arg("hi"), py::arg("lo"), py::arg("tops"), py::arg("chunk"),
        py::arg("width"), py::arg("first"), py::arg("clear"));
  m.def("combine", &combine, py::arg("hi"), py::arg("lo"), py::arg("local_tops"), py::arg("global_tops"),
        py::arg("chunk"), py::arg("width"));
  m.def("tops", &tops, py::arg("grad"), py::arg("tops"), py::arg("chunk"), py::arg("width"));
  m.def("fold", &fold, py::arg("grad"), py::arg("hi"), py::arg("lo"), py::arg("bin_tops"), py::arg("global_tops"),
        py::arg("chunk"), py::arg("width"), py::arg("have_bins"));
  m.def("finalize", &finalize, py::arg("v"), py::arg("global_tops"), py::arg("out"), py::arg("chunk"),
        py::arg("width"), py::arg("divisor"));
  m.def("matmul_nt", &matmul_nt, py::arg("a"), py::arg("b"), py::arg("kernel") = "auto");
  m.def("bmm_nt", &bmm_nt, py::arg("a"), py::arg("b"), py::arg("kernel") = "auto");
}
