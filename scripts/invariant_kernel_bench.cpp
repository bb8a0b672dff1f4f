// The batch-invariant quantized kernel vs the default one, standalone (no torch), 1 thread, CPU time:
//   g++ -O3 -std=c++17 -fno-math-errno -Icsrc scripts/invariant_kernel_bench.cpp csrc/quant_gemm_avx512.cpp \
//       -o /tmp/ikb && /tmp/ikb ROWS [QTYPE: 3 = Q4_1, 8 = Q8_0, 100 = QX] [N: 49152 streams from memory, 2560 fits L3]
// K = 960 (the default model's hidden size); random bytes as weights (the speed does not depend on them).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <ctime>
#include "quant_gemm.h"
using namespace pagedllm::quant;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const int64_t n = argc > 3 ? atoi(argv[3]) : 2560, k = 960, m = argc > 1 ? atoi(argv[1]) : 1; const int qt = argc > 2 ? atoi(argv[2]) : 3;
  const int64_t panels = n / 16, bb = block_bytes(qt);
  std::vector<uint8_t> packed(panels * (k / 32) * bb);
  for (auto& b : packed) b = rand() & 0x3f;  // small fp16 scales
  std::vector<float> x(m * k), y(m * n);
  for (auto& v : x) v = (rand() % 1000) / 1000.0f;
  Args a{qt, x.data(), k, packed.data(), nullptr, y.data(), n, m, n, k};
  const int reps = n > 10000 ? 10 : 200;
  for (int round = 0; round < 3; ++round) {
    for (int inv = 0; inv < 2; ++inv) {
      double t = cpu();
      for (int rep = 0; rep < reps; ++rep) (inv ? quant_panels_invariant_avx512 : quant_panels_avx512)(a, 0, panels);
      printf("%s %.3f ms/call  ", inv ? "inv" : "def", (cpu() - t) * 1e3 / reps);
    }
    printf("\n");
  }
}
