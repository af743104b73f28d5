// What one dependent phase of a persistent decode step costs, by how the phases are joined.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/phase_floor benchmarks/phase_floor.cu
//   /tmp/phase_floor [--phases 640] [--repeats 7] [--rows 1024] [--pool-mb 24]
//
// A phase here is what every phase of kernels/triton_decode_step.py is: read a whole row x [D]
// that the other blocks wrote in the phase before, compute this block's share of y = W_p x
// (W_p: `rows` x D bf16, a new matrix each phase out of a pool that stays in L2, as the embedded
// model's 26 MB of weights do), write that share, and signal that it is done. The next phase
// may read y only once every block has signalled. Joined three ways:
//   grid            G blocks, one an SM; the signal is an atomic add (release) on one counter
//                   in global memory, the wait a poll of it (acquire), y goes through L2.
//                   This is how the Triton persistent kernels join their phases.
//   cluster-global  one thread-block cluster of C blocks; the join is the cluster's hardware
//                   barrier (barrier.cluster arrive.release / wait.acquire), y goes through L2.
//   cluster-dsmem   the same barrier; each block keeps its share of y in its own shared memory
//                   and the others read it there (distributed shared memory), not from L2.
// With --rows 0 a phase computes nothing but a copy of its share (the join's own cost).
// Prints one JSON object: microseconds a phase for each way and block count, medians of
// `repeats` timed launches of `phases` phases each, after one warm launch.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cg = cooperative_groups;

constexpr int D = 384;          // the embedded target's width
constexpr int THREADS = 256;    // 8 warps a block
constexpr int MAX_CLUSTER = 16;

struct Args {
  int phases;
  int rows;                     // output rows of a phase's matrix (0: no matrix, a copy)
  int pool_matrices;            // matrices in the pool, used in turn
  const __nv_bfloat16* pool;    // pool_matrices x rows x D
  float* y;                     // [2][D] rows in global memory (grid, cluster-global)
  float* sink;                  // [gridDim] the rows past D, so that their work stays
  unsigned* counter;            // grid: arrivals so far
};

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

// Rows [r0, r1) of W_p x (one warp a row, 8-byte bf16 loads), or a copy of x where rows == 0.
// Each row lands in out(r) for r < D; the rest are summed into *extra.
template <typename Out>
__device__ void phase_rows(const Args& a, int p, const float* x, int r0, int r1, Out out, float* extra) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (a.rows == 0) {
    for (int r = r0 + threadIdx.x; r < r1; r += THREADS) out(r, x[r] * 0.5f + 1.0f);
    return;
  }
  const __nv_bfloat16* w = a.pool + (size_t)(p % a.pool_matrices) * a.rows * D;
  float spill = 0.0f;
  for (int r = r0 + warp; r < r1; r += THREADS / 32) {
    const __nv_bfloat162* row = reinterpret_cast<const __nv_bfloat162*>(w + (size_t)r * D);
    float acc = 0.0f;
    for (int k = lane; k < D / 2; k += 32) {
      float2 wk = __bfloat1622float2(row[k]);
      acc += wk.x * x[2 * k] + wk.y * x[2 * k + 1];
    }
    for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
      if (r < D) out(r, acc * 1e-3f + 1.0f);   // kept near 1 over the phases
      else spill += acc;
    }
  }
  if (lane == 0 && spill != 0.0f) atomicAdd(extra, spill);
}

// The block's share of the phase's rows: D rows (and the rest of `rows`) split evenly.
__device__ void share(const Args& a, int blocks, int rank, int* r0, int* r1) {
  int total = ::max(a.rows, D), per = (total + blocks - 1) / blocks;
  *r0 = ::min(total, rank * per);
  *r1 = ::min(total, *r0 + per);
}

__global__ void __launch_bounds__(THREADS, 1) grid_phases(Args a) {
  __shared__ float x[D];
  int G = gridDim.x, r0, r1;
  share(a, G, blockIdx.x, &r0, &r1);
  for (int p = 0; p < a.phases; ++p) {
    if (threadIdx.x == 0)
      while (load_acquire(a.counter) < (unsigned)(p * G)) {
      }
    __syncthreads();
    const float* src = a.y + (p & 1) * D;
    float* dst = a.y + ((p + 1) & 1) * D;
    for (int i = threadIdx.x; i < D; i += THREADS) x[i] = __ldcg(src + i);
    __syncthreads();
    phase_rows(a, p, x, r0, r1, [&](int r, float v) { __stcg(dst + r, v); }, a.sink + blockIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) add_release(a.counter);
  }
}

template <bool DSMEM>
__global__ void __launch_bounds__(THREADS, 1) cluster_phases(Args a) {
  __shared__ float x[D];
  __shared__ float mine[2][D];      // DSMEM: this block's share of y, at its global indices
  cg::cluster_group cluster = cg::this_cluster();
  int C = cluster.num_blocks(), rank = cluster.block_rank(), r0, r1;
  share(a, C, rank, &r0, &r1);
  int per = (::max(a.rows, D) + C - 1) / C;
  for (int i = threadIdx.x; i < D; i += THREADS) mine[0][i] = 1.0f;   // every block holds row 0 whole
  cluster.sync();
  for (int p = 0; p < a.phases; ++p) {
    for (int i = threadIdx.x; i < D; i += THREADS) {
      if (DSMEM) {
        int owner = p == 0 ? rank : i / per;
        x[i] = cluster.map_shared_rank(&mine[p & 1][0], owner)[i];
      } else {
        x[i] = __ldcg(a.y + (p & 1) * D + i);
      }
    }
    __syncthreads();
    if (DSMEM) {
      phase_rows(a, p, x, r0, r1, [&](int r, float v) { mine[(p + 1) & 1][r] = v; }, a.sink + rank);
    } else {
      float* dst = a.y + ((p + 1) & 1) * D;
      phase_rows(a, p, x, r0, r1, [&](int r, float v) { __stcg(dst + r, v); }, a.sink + rank);
    }
    cluster.sync();   // barrier.cluster.arrive.release + wait.acquire, every thread
  }
}

struct Timing {
  std::string way;
  int blocks;
  float us_per_phase;
};

template <typename Launch>
float time_launches(Launch launch, unsigned* counter, int phases, int repeats) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<float> us;
  for (int i = 0; i <= repeats; ++i) {   // the first launch warms
    CHECK(cudaMemset(counter, 0, sizeof(unsigned)));
    CHECK(cudaEventRecord(start));
    launch();
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    CHECK(cudaGetLastError());
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    if (i) us.push_back(1e3f * ms / phases);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  return us[us.size() / 2];
}

// A launch of one cluster of C blocks (not copyable: cfg points at attr).
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr = {};
  explicit ClusterLaunch(int C) {
    cfg.gridDim = dim3(C);
    cfg.blockDim = dim3(THREADS);
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = C;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

template <typename Kernel>
bool cluster_fits(Kernel kernel, int C) {
  ClusterLaunch launch(C);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.cfg) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return clusters > 0;
}

template <typename Kernel>
void launch_cluster(Kernel kernel, int C, const Args& a) {
  ClusterLaunch launch(C);
  CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, a));
}

int main(int argc, char** argv) {
  int phases = 640, repeats = 7, rows = 1024;
  double pool_mb = 24.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--phases") phases = std::atoi(argv[i + 1]);
    else if (k == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (k == "--rows") rows = std::atoi(argv[i + 1]);
    else if (k == "--pool-mb") pool_mb = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (phases < 1 || repeats < 1 || rows < 0 || (rows && rows < D) || pool_mb <= 0) {
    std::fprintf(stderr, "need --phases >= 1, --repeats >= 1, --rows 0 or >= %d, --pool-mb > 0\n", D);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  size_t matrix = (size_t)std::max(rows, 1) * D;
  int pool_matrices = std::max(1, (int)(pool_mb * (1 << 20) / (matrix * sizeof(__nv_bfloat16))));
  std::vector<__nv_bfloat16> host(matrix * pool_matrices);
  unsigned seed = 1;
  for (auto& v : host) {
    seed = seed * 1664525u + 1013904223u;
    v = __float2bfloat16(((seed >> 9) & 0xffff) / 65536.0f - 0.5f);
  }
  Args a = {};
  a.phases = phases;
  a.rows = rows;
  a.pool_matrices = pool_matrices;
  __nv_bfloat16* pool;
  CHECK(cudaMalloc(&pool, host.size() * sizeof(__nv_bfloat16)));
  CHECK(cudaMemcpy(pool, host.data(), host.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  a.pool = pool;
  std::vector<float> ones(2 * D, 1.0f);
  CHECK(cudaMalloc(&a.y, 2 * D * sizeof(float)));
  CHECK(cudaMemcpy(a.y, ones.data(), 2 * D * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&a.sink, 1024 * sizeof(float)));
  CHECK(cudaMemset(a.sink, 0, 1024 * sizeof(float)));
  CHECK(cudaMalloc(&a.counter, sizeof(unsigned)));
  CHECK(cudaFuncSetAttribute(cluster_phases<true>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(cluster_phases<false>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

  std::vector<Timing> out;
  for (int G : {prop.multiProcessorCount, 16, 8}) {
    float us = time_launches([&] { grid_phases<<<G, THREADS>>>(a); }, a.counter, phases, repeats);
    out.push_back({"grid", G, us});
  }
  std::vector<std::string> skipped;
  for (int C : {8, MAX_CLUSTER}) {
    if (!cluster_fits(cluster_phases<true>, C) || !cluster_fits(cluster_phases<false>, C)) {
      skipped.push_back("cluster of " + std::to_string(C) + ": cudaOccupancyMaxActiveClusters says none fits");
      continue;
    }
    out.push_back({"cluster-global", C, time_launches([&] { launch_cluster(cluster_phases<false>, C, a); },
                                                      a.counter, phases, repeats)});
    out.push_back({"cluster-dsmem", C, time_launches([&] { launch_cluster(cluster_phases<true>, C, a); },
                                                     a.counter, phases, repeats)});
  }
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, \"phases\": %d, \"repeats\": %d, "
              "\"rows\": %d, \"width\": %d, \"pool_matrices\": %d, \"pool_bytes\": %zu,\n \"us_per_phase\": [",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize, phases, repeats, rows, D, pool_matrices,
              host.size() * sizeof(__nv_bfloat16));
  for (size_t i = 0; i < out.size(); ++i)
    std::printf("%s\n  {\"way\": \"%s\", \"blocks\": %d, \"us\": %.3f}", i ? "," : "", out[i].way.c_str(),
                out[i].blocks, out[i].us_per_phase);
  std::printf("],\n \"skipped\": [");
  for (size_t i = 0; i < skipped.size(); ++i) std::printf("%s\"%s\"", i ? ", " : "", skipped[i].c_str());
  std::printf("]}\n");
  return 0;
}
