// Apple M-series tuning: 128-byte cache lines and large shared L2 change the
// blocking, not the instruction set (the apple_* variants use the NEON layer,
// compiled with -mcpu=apple-m1 / apple-m2 so that the scheduler model and
// bf16/i8mm availability match the chip).
#pragma once

namespace cpuinfer::tuning {
constexpr int kCacheLine = 128;
}  // namespace cpuinfer::tuning
