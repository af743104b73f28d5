// Whether the SM that reads a weight tile decides if the tile stays in L2 (issues #15, #16).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/l2_sides benchmarks/l2_sides.cu
//   /tmp/l2_sides [--steps 200] [--repeats 5] [--pools 8,16,20,24,28,32,36,40,44,48,56,64] [--second-mb 4.5]
//
// Hopper's L2 has two partitions, and a partition caches the lines that the SMs on its side
// read, so a line read from both sides may take a place in each. A working set read from
// everywhere may then fit in about half of L2. The persistent kernels deal their units by
// program id, and the block scheduler picks the SM of each program at every launch, so a
// weight tile may be read from the other side at the next step. This kernel runs `steps`
// steps joined by a grid barrier, as a persistent decode step does. At each step every block
// reads its own 1/G of a pool of S MB through L2 (ld.global.cg, not L1), in one of three ways:
//   pid     block b reads chunk b at every step: the same SM reads a chunk all launch long
//   sm      chunk = the rank of the block's SM (%smid), the same SM at every launch too
//   rotate  block b reads chunk (b + 37 s) mod G at step s: another SM every step
// One block an SM (dynamic shared memory forces it). It prints one JSON object: µs a step
// (median of `repeats` launches after one warm launch) and the pool's bytes over that time,
// for each pool size and way; and how many blocks were on the SM of the launch before
// (`same_sm_as_last_launch`), which says whether pid and sm differ across launches.
//
// Then, as a speculative step alternates the verification's launch (the target's weights) and
// the draft's (the drafter's), launches of one step over a pool of S MB alternate with launches
// over a second pool of `--second-mb` MB, both read the `pid` way: `alternating` gives µs a
// pair of launches, each pool's launches alone, and what alternating adds (`extra_us`), the
// launches' own cost cancelling. 0 skips it.
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

constexpr int THREADS = 512;
constexpr int PAD_SHARED = 120 * 1024;   // two blocks would need more than an SM has
constexpr int MAX_SM_ID = 1024;

__device__ __forceinline__ unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void read_steps(const uint4* pool, size_t chunk, int steps, int way, const int* rank_of_sm,
                           unsigned* counter, unsigned* sink, int* sm_of_block) {
  extern __shared__ unsigned pad[];
  const unsigned sm = sm_id();
  const int G = gridDim.x;
  unsigned acc = 0;
  for (int s = 0; s < steps; ++s) {
    const int rank = way == 0 ? blockIdx.x : way == 1 ? rank_of_sm[sm] : (blockIdx.x + 37 * (s + 1)) % G;
    const uint4* p = pool + (size_t)rank * chunk;
#pragma unroll 4
    for (size_t i = threadIdx.x; i < chunk; i += THREADS) {
      uint4 v = __ldcg(p + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {     // the grid barrier of the persistent kernels: arrive, then poll
      __threadfence();
      atomicAdd(counter, 1u);
      const unsigned target = (unsigned)(s + 1) * G;
      while (load_acquire(counter) < target) {
      }
    }
    __syncthreads();
  }
  pad[threadIdx.x] = acc;
  __syncthreads();
  if (pad[(threadIdx.x + 1) % THREADS] == 0x9e3779b9u) sink[blockIdx.x] = acc;   // keeps the loads
  if (threadIdx.x == 0) sm_of_block[blockIdx.x] = (int)sm;
}

struct Pair {       // µs a launch of the first pool alone, of the second alone, and a pair alternating
  double pool_mb, a_us, b_us, both_us;
};

struct Row {
  double pool_mb;
  const char* way;
  double us;
  double bytes;   // what a step reads: G whole chunks
};

int main(int argc, char** argv) {
  int steps = 200, repeats = 5;
  double second_mb = 4.5;
  std::vector<double> pools = {8, 16, 20, 24, 28, 32, 36, 40, 44, 48, 56, 64};
  for (int i = 1; i < argc; i += 2) {
    std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "option %s needs a value\n", k.c_str());
      return 2;
    }
    if (k == "--steps") steps = std::atoi(argv[i + 1]);
    else if (k == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (k == "--second-mb") second_mb = std::atof(argv[i + 1]);
    else if (k == "--pools") {
      pools.clear();
      std::stringstream list(argv[i + 1]);
      std::string item;
      while (std::getline(list, item, ',')) pools.push_back(std::atof(item.c_str()));
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  bool pools_ok = !pools.empty();
  for (double mb : pools) pools_ok = pools_ok && mb > 0 && mb <= 4096;
  if (steps < 1 || repeats < 1 || !pools_ok || !(second_mb >= 0 && second_mb <= 4096)) {
    std::fprintf(stderr, "need --steps >= 1, --repeats >= 1, --pools of sizes in (0, 4096] MB, --second-mb in "
                 "[0, 4096]\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int G = prop.multiProcessorCount;
  const double most_mb = *std::max_element(pools.begin(), pools.end());
  const size_t most_vec = (size_t)(most_mb * (1 << 20)) / sizeof(uint4);
  const size_t second_vec = (size_t)(second_mb * (1 << 20)) / sizeof(uint4);
  uint4 *pool, *second;
  CHECK(cudaMalloc(&pool, most_vec * sizeof(uint4)));
  CHECK(cudaMemset(pool, 0x5a, most_vec * sizeof(uint4)));
  CHECK(cudaMalloc(&second, std::max<size_t>(second_vec, 1) * sizeof(uint4)));
  CHECK(cudaMemset(second, 0x3c, std::max<size_t>(second_vec, 1) * sizeof(uint4)));
  unsigned *counter, *sink;
  int *rank_of_sm, *sm_of_block;
  CHECK(cudaMalloc(&counter, sizeof(unsigned)));
  CHECK(cudaMalloc(&sink, G * sizeof(unsigned)));
  CHECK(cudaMalloc(&rank_of_sm, MAX_SM_ID * sizeof(int)));
  CHECK(cudaMalloc(&sm_of_block, G * sizeof(int)));
  CHECK(cudaFuncSetAttribute(read_steps, cudaFuncAttributeMaxDynamicSharedMemorySize, PAD_SHARED));

  auto launch_over = [&](const uint4* from, size_t chunk, int n, int way) {
    CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned)));
    read_steps<<<G, THREADS, PAD_SHARED>>>(from, chunk, n, way, rank_of_sm, counter, sink, sm_of_block);
    CHECK(cudaGetLastError());
  };
  auto launch = [&](size_t chunk, int n, int way) { launch_over(pool, chunk, n, way); };
  // each SM's rank: the block it ran in a first launch (every SM runs exactly one block)
  std::vector<int> sms(G), ranks(MAX_SM_ID, 0), last(G);
  launch(1, 1, 0);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(sms.data(), sm_of_block, G * sizeof(int), cudaMemcpyDeviceToHost));
  for (int b = 0; b < G; ++b) {
    if (sms[b] < 0 || sms[b] >= MAX_SM_ID) {
      std::fprintf(stderr, "SM id %d out of range\n", sms[b]);
      return 1;
    }
    ranks[sms[b]] = b;
  }
  CHECK(cudaMemcpy(rank_of_sm, ranks.data(), MAX_SM_ID * sizeof(int), cudaMemcpyHostToDevice));
  // does a block land on the same SM launch after launch?
  int same = 0, compared = 0;
  last = sms;
  for (int r = 0; r < 20; ++r) {
    launch(1, 1, 0);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(sms.data(), sm_of_block, G * sizeof(int), cudaMemcpyDeviceToHost));
    for (int b = 0; b < G; ++b) same += sms[b] == last[b];
    compared += G;
    last = sms;
  }

  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // µs of one of `count` calls of run(), median of `repeats` timed rounds after a warm one
  auto time_us = [&](const std::function<void()>& run, int count) {
    for (int i = 0; i < count; ++i) run();
    std::vector<float> us;
    for (int r = 0; r < repeats; ++r) {
      CHECK(cudaEventRecord(start));
      for (int i = 0; i < count; ++i) run();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      us.push_back(1e3f * ms / count);
    }
    std::sort(us.begin(), us.end());
    return (double)us[us.size() / 2];
  };
  const char* names[3] = {"pid", "sm", "rotate"};
  std::vector<Row> rows;
  for (double mb : pools) {
    const size_t chunk = (size_t)(mb * (1 << 20)) / sizeof(uint4) / G;
    for (int way = 0; way < 3; ++way) {
      const double us = time_us([&] { launch(chunk, steps, way); }, 1) / steps;
      rows.push_back({mb, names[way], us, (double)chunk * G * sizeof(uint4)});
    }
  }
  std::vector<Pair> pairs;
  const size_t second_chunk = second_vec / G;
  for (double mb : second_chunk ? pools : std::vector<double>{}) {
    const size_t chunk = (size_t)(mb * (1 << 20)) / sizeof(uint4) / G;
    const int count = 200;
    const double a = time_us([&] { launch_over(pool, chunk, 1, 0); }, count);
    const double b = time_us([&] { launch_over(second, second_chunk, 1, 0); }, count);
    const double both = time_us([&] { launch_over(pool, chunk, 1, 0); launch_over(second, second_chunk, 1, 0); },
                                count);
    pairs.push_back({mb, a, b, both});
  }
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, \"steps\": %d, \"repeats\": %d, "
              "\"same_sm_as_last_launch\": %.3f,\n \"us_per_step\": [",
              prop.name, G, prop.l2CacheSize, steps, repeats, compared ? (double)same / compared : 0.0);
  for (size_t i = 0; i < rows.size(); ++i)
    std::printf("%s\n  {\"pool_mb\": %g, \"way\": \"%s\", \"us\": %.3f, \"GBps\": %.0f}", i ? "," : "",
                rows[i].pool_mb, rows[i].way, rows[i].us, rows[i].bytes / (rows[i].us * 1e3));
  std::printf("],\n \"second_mb\": %g, \"alternating\": [", second_mb);
  for (size_t i = 0; i < pairs.size(); ++i)
    std::printf("%s\n  {\"pool_mb\": %g, \"a_us\": %.3f, \"b_us\": %.3f, \"both_us\": %.3f, \"extra_us\": %.3f}",
                i ? "," : "", pairs[i].pool_mb, pairs[i].a_us, pairs[i].b_us, pairs[i].both_us,
                pairs[i].both_us - pairs[i].a_us - pairs[i].b_us);
  std::printf("]}\n");
  return 0;
}
