# The GPU targets, as CMake CUDA_ARCHITECTURES, in circle_loss_cuda_architectures.
#
# TORCH_CUDA_ARCH_LIST (environment or cache), as torch spells it ("8.0;9.0",
# "8.6+PTX", spaces allowed): what it names that the library and the toolkit
# both support, each entry dropped with a message saying why (NGC containers
# set long lists). Unset: the GPUs visible at build time, as
# torch.utils.cpp_extension builds; with none visible, every architecture the
# library supports, with PTX for the newest, which later GPUs compile.
#
# Machine code for 9.0 is built for sm_90a, Hopper's own target, whose
# warpgroup MMA the half-precision tiles use: it runs on exactly the devices
# sm_90 code runs on. Every other target from sm_80 on takes the mma.sync
# tiles, and sm_75 (T4) the cuBLAS strips alone: the kernels check at run
# time which their binary holds (mma_tiles_built).

# From 7.5 on: what the library supports (and tests compile for).
set(circle_loss_supported_architectures 75 80 86 89 90 100 120)

function(circle_loss_toolkit_architectures out)
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-code
                  OUTPUT_VARIABLE codes OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE failed)
  if(failed)
    message(FATAL_ERROR "circle_loss: ${CMAKE_CUDA_COMPILER} --list-gpu-code failed")
  endif()
  string(REGEX MATCHALL "sm_[0-9]+" codes "${codes}")
  list(TRANSFORM codes REPLACE "sm_" "")
  set(${out} "${codes}" PARENT_SCOPE)
endfunction()

# The compute capabilities of the GPUs this machine shows torch, "8.6;9.0".
function(circle_loss_visible_gpus out)
  set(${out} "" PARENT_SCOPE)
  if(NOT TORCH_CUDA_LIBRARIES)
    return()  # a CPU torch sees no GPU
  endif()
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import torch; print(';'.join('%d.%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())))"
    OUTPUT_VARIABLE visible OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE failed)
  if(NOT failed)
    set(${out} "${visible}" PARENT_SCOPE)
  endif()
endfunction()

function(circle_loss_cuda_architectures out)
  circle_loss_toolkit_architectures(toolkit)
  # Set but empty counts as unset, as it does for torch.
  if(NOT "${TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(requested "${TORCH_CUDA_ARCH_LIST}")
    set(source "TORCH_CUDA_ARCH_LIST")
  elseif(NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(requested "$ENV{TORCH_CUDA_ARCH_LIST}")
    set(source "TORCH_CUDA_ARCH_LIST")
  else()
    circle_loss_visible_gpus(requested)
    set(source "the GPUs visible at build time")
    if(requested STREQUAL "")
      set(requested "")
      foreach(arch IN LISTS circle_loss_supported_architectures)
        if(arch IN_LIST toolkit)
          string(REGEX REPLACE "([0-9]+)([0-9])$" "\\1.\\2" dotted "${arch}")
          list(APPEND requested "${dotted}")
        endif()
      endforeach()
      list(POP_BACK requested newest)
      list(APPEND requested "${newest}+PTX")
      set(source "no GPU visible at build time: every architecture the library supports")
    endif()
  endif()
  string(REPLACE " " ";" requested "${requested}")
  set(architectures "")
  foreach(entry IN LISTS requested)
    string(REGEX MATCH "^([0-9]+)\\.([0-9]+)a?(\\+PTX)?$" parsed "${entry}")
    if(NOT parsed)
      message(STATUS "circle_loss: dropped ${entry} from ${source}: not a compute capability such as 8.6 or 8.6+PTX")
      continue()
    endif()
    set(arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    set(with_ptx "${CMAKE_MATCH_3}")
    if(arch LESS 75)
      message(STATUS "circle_loss: dropped ${entry} from ${source}: the library supports 7.5 (T4) and later")
      continue()
    endif()
    if(NOT arch IN_LIST toolkit)
      message(STATUS "circle_loss: dropped ${entry} from ${source}: ${CMAKE_CUDA_COMPILER} does not build sm_${arch}")
      continue()
    endif()
    if(arch STREQUAL "90")
      list(APPEND architectures "90a-real")
    else()
      list(APPEND architectures "${arch}-real")
    endif()
    if(with_ptx)
      list(APPEND architectures "${arch}-virtual")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES architectures)
  if(NOT architectures)
    message(FATAL_ERROR "circle_loss: no GPU architecture left to build from ${source} (${requested})")
  endif()
  message(STATUS "circle_loss: CUDA targets from ${source}: ${architectures}")
  set(${out} "${architectures}" PARENT_SCOPE)
endfunction()
