// Entry points of Ostinato's code in the CUDA backend (ostinato_ops.cu): the decode-graph ops (called
// from the two cases that native/patches/20 adds to ggml-cuda.cu) and the prefetch's copy kernel
// (exported through the registry's get_proc_address, native/patches/22).
#pragma once

struct ggml_tensor;
struct ggml_backend_cuda_context;

// True for a node that is one of Ostinato's GPU ops (see ostinato_ops.h) with supported types, which
// CUDA device `device` can run (a count op only where its table lives).
bool ggml_cuda_ostinato_supports_op(const ggml_tensor * op, int device);
// Launches the node's kernel on the context's stream; false if the node is not an Ostinato op.
bool ggml_cuda_ostinato_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

struct ostinato_copy;
typedef struct ggml_backend * ggml_backend_t;
// "ostinato_cuda_gather": copies the n (<= OSTINATO_COPY_MAX) chunks of `c` with one kernel on the
// stream of `backend` (a CUDA backend); asynchronous (record an event on the backend to join). Returns
// false, launching nothing, for n outside 1..OSTINATO_COPY_MAX or a backend that is not CUDA's.
extern "C" bool ostinato_cuda_gather(ggml_backend_t backend, const ostinato_copy * c, int n);
// "ostinato_cuda_host_mapped": true when the host address p lies in page-locked memory that CUDA
// kernels can read at the same address (unified addressing), as the copy kernel needs.
extern "C" bool ostinato_cuda_host_mapped(const void * p);
