// What the CPU branch's first-use checks share (cpu_branch/gemm.cpp, dot.cpp, mxfp4.cpp): whether this
// CPU has the AVX-512 set their kernels are compiled for, and the checks' random test data.
#pragma once

#include <cstdint>

// AVX-512 F, BW, VL, DQ and VNNI, and F16C: what the AVX-512 kernels are compiled with.
inline bool ost_cpu_has_avx512_vnni() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

// ~N(0, 1) times 1.7 from a sum of four xorshift uniforms: the checks' weights and activations, the
// same sequence for the same seed on every machine.
struct ost_check_rng {
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    float operator()() {
        float a = 0;
        for (int i = 0; i < 4; ++i) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            a += (float) (s >> 40) / (float) (1 << 24) - 0.5f;
        }
        return a * 1.7f;
    }
};
