// The CPU kernel for x86-64 CPUs with AVX2 and FMA (x86-64-v3), and its AVX-512 sweeps (vec_exp.h, behind target
// attributes). The target pragma comes before every include, so this whole translation unit, ATen's Vectorized<>
// included, is compiled for AVX2 + FMA as with -mavx2 -mfma, as ATen
// compiles its own *.AVX2.cpp kernels. Risk of that: an inline function of a shared header that this file and a
// baseline file both emit out of line is one symbol, and the linker may keep this file's AVX2 copy (torch's build
// links the objects in name order, not in setup.py's order). So the code the kernels share is kept out of the
// symbol table here: the weight maths has internal linkage (uncertainty_weights.h), the target checks and the dtype
// dispatch (c10 message templates) live in the baseline file. Checked with nm/objdump on the built objects: no weak
// symbol this object shares with another contains a VEX-encoded instruction. Other compilers (clang ignores the
// pragma) get no AVX2 kernel.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe")
// GCC's target pragma enables the instructions but not the feature macros that -mavx2 -mfma would define, which
// ATen's and Sleef's headers test to declare their AVX2 forms: define them as those flags would.
#ifndef __SSE3__
#define __SSE3__ 1
#endif
#ifndef __SSSE3__
#define __SSSE3__ 1
#endif
#ifndef __SSE4_1__
#define __SSE4_1__ 1
#endif
#ifndef __SSE4_2__
#define __SSE4_2__ 1
#endif
#ifndef __POPCNT__
#define __POPCNT__ 1
#endif
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __BMI__
#define __BMI__ 1
#endif
#ifndef __BMI2__
#define __BMI2__ 1
#endif
#ifndef __LZCNT__
#define __LZCNT__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define CALIBKERNELS_ISA isa_avx2
#include "cpu/uncertainty_weighted_ce_kernel.h"
#endif
