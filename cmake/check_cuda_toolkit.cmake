# circle_loss_check_cuda_toolkit(TORCH_VERSION TORCH_CUDA): a CUDA build of
# torch links its CMake targets against the CUDA toolkit of its CUDA version,
# so its CMake config fails without one ("Your installed Caffe2 version uses
# CUDA but I cannot find the CUDA libraries", or a missing CUDA:: target).
# This runs first and fails with what is missing and what to do instead:
# nvcc of torch's CUDA major version, and the development libraries that
# torch's config links (the CUDA runtime, cuBLAS, cuBLASLt, cuFFT, cuRAND,
# NVRTC). The toolkit is looked for where CMake looks for it: CUDACXX,
# CUDA_HOME or CUDA_PATH, nvcc on PATH, /usr/local/cuda.
function(circle_loss_check_cuda_toolkit torch_version torch_cuda)
  set(hints "")
  if(CUDA_TOOLKIT_ROOT_DIR)
    list(APPEND hints "${CUDA_TOOLKIT_ROOT_DIR}/bin")
  endif()
  foreach(variable CUDAToolkit_ROOT CUDA_HOME CUDA_PATH CUDA_TOOLKIT_ROOT)
    if(DEFINED ENV{${variable}})
      list(APPEND hints "$ENV{${variable}}/bin")
    endif()
  endforeach()
  if(DEFINED ENV{CUDACXX})
    set(nvcc "$ENV{CUDACXX}")
  elseif(CMAKE_CUDA_COMPILER)
    set(nvcc "${CMAKE_CUDA_COMPILER}")
  else()
    find_program(nvcc nvcc HINTS ${hints} PATHS /usr/local/cuda/bin NO_CACHE)
  endif()

  set(advice
    "Install the CUDA toolkit ${torch_cuda} (at least nvcc and the development packages of the CUDA "
    "runtime, cuBLAS, cuFFT, cuRAND and NVRTC: cuda-nvcc, cuda-cudart-dev, libcublas-dev, libcufft-dev, "
    "libcurand-dev and cuda-nvrtc-dev in NVIDIA's package repositories) and point CUDA_HOME at it, "
    "or build for the CPU alone against a CPU torch (pip install torch==2.13.0 with PyTorch's CPU "
    "package index as --index-url, as the README says).")
  string(CONCAT advice ${advice})
  string(REGEX MATCH "^[0-9]+" torch_cuda_major "${torch_cuda}")

  if(NOT nvcc OR NOT EXISTS "${nvcc}")
    message(FATAL_ERROR
      "circle_loss: torch ${torch_version} is a CUDA build (torch.version.cuda = ${torch_cuda}), and "
      "building against it needs the CUDA toolkit of that version; no nvcc was found (CUDACXX, CUDA_HOME, "
      "CUDA_PATH, PATH, /usr/local/cuda). ${advice}")
  endif()

  execute_process(COMMAND "${nvcc}" --version OUTPUT_VARIABLE nvcc_says RESULT_VARIABLE status)
  string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _ "${nvcc_says}")
  set(nvcc_version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
  if(NOT status EQUAL 0 OR NOT CMAKE_MATCH_1 STREQUAL torch_cuda_major)
    message(FATAL_ERROR
      "circle_loss: torch ${torch_version} is a CUDA build (torch.version.cuda = ${torch_cuda}), but "
      "${nvcc} is CUDA ${nvcc_version}: the toolkit's major version must be torch's. ${advice}")
  endif()

  # The toolkit's root, as nvcc itself has it (TOP): an nvcc on PATH may be a
  # link or a wrapper script.
  execute_process(COMMAND "${nvcc}" --dryrun -c -x cu /dev/null -o /dev/null
                  ERROR_VARIABLE nvcc_steps OUTPUT_VARIABLE nvcc_out)
  string(REGEX MATCH "TOP=([^\n]+)" _ "${nvcc_steps}${nvcc_out}")
  if(CMAKE_MATCH_1)
    file(REAL_PATH "${CMAKE_MATCH_1}" root)
  else()
    file(REAL_PATH "${nvcc}" nvcc_file)
    get_filename_component(root "${nvcc_file}" DIRECTORY)
    get_filename_component(root "${root}" DIRECTORY)
  endif()
  set(missing "")
  foreach(library cudart cublas cublasLt cufft curand nvrtc)
    find_library(found_${library} ${library} HINTS "${root}"
                 PATH_SUFFIXES lib64 lib targets/x86_64-linux/lib targets/sbsa-linux/lib NO_DEFAULT_PATH NO_CACHE)
    if(NOT found_${library})
      list(APPEND missing "lib${library}")
    endif()
  endforeach()
  foreach(header cuda_runtime.h cublas_v2.h cufft.h curand.h nvrtc.h)
    find_path(found_header ${header} HINTS "${root}"
              PATH_SUFFIXES include targets/x86_64-linux/include targets/sbsa-linux/include
              NO_DEFAULT_PATH NO_CACHE)
    if(NOT found_header)
      list(APPEND missing "${header}")
    endif()
    unset(found_header)
  endforeach()
  if(missing)
    list(JOIN missing ", " missing)
    message(FATAL_ERROR
      "circle_loss: torch ${torch_version} is a CUDA build (torch.version.cuda = ${torch_cuda}), and "
      "its CMake config links parts of the CUDA toolkit that ${root} (the toolkit of ${nvcc}, CUDA "
      "${nvcc_version}) lacks: ${missing}. ${advice}")
  endif()
  # torch's config looks again (FindCUDA, which reads neither CUDA_HOME nor
  # CUDACXX, and enable_language(CUDA), which takes the first nvcc on PATH):
  # both are to find the toolkit checked here.
  set(CUDA_TOOLKIT_ROOT_DIR "${root}" CACHE PATH "The CUDA toolkit that torch's CMake config uses")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS "${root}/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "${root}/bin/nvcc" CACHE FILEPATH "nvcc of that toolkit")
  endif()
  message(STATUS "circle_loss: CUDA toolkit ${nvcc_version} at ${root} for torch ${torch_version} "
                 "(CUDA ${torch_cuda})")
endfunction()
