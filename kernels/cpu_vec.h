/* 16-lane fp32 vectors (GCC vector extensions) for the kernels that block rows:
 * unaligned loads and stores, and a broadcast. */
#ifndef PAGEDSERVE_CPU_VEC_H
#define PAGEDSERVE_CPU_VEC_H

#include <string.h>

typedef float v16f __attribute__((vector_size(64)));

static inline v16f ld16(const float *p)
{
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16(float *p, v16f v)
{
    memcpy(p, &v, sizeof v);
}

static inline v16f splat(float f)
{
    return (v16f){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f};
}

#endif
