#pragma once
// Stand-in for the header that CUDA builds of torch generate and CPU builds do
// not ship; used only to compile-check the CUDA sources against a CPU torch
// (CIRCLE_LOSS_CUDA_COMPILE_CHECK). Same content as torch's generated one.
#define C10_CUDA_BUILD_SHARED_LIBS
