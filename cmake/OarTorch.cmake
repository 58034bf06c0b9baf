# Locate LibTorch from the pip `torch` wheel and define imported targets:
#   oar_torch::cpu   libtorch, libtorch_cpu, libc10 + include dirs + ABI define
#   oar_torch::cuda  libtorch_cuda, libc10_cuda (only when the wheel has CUDA)
#
# Why not find_package(Torch): the CUDA builds of the wheel ship a TorchConfig.cmake that hard-fails
# (FATAL_ERROR, not QUIET) unless a full CUDA toolkit with cuDNN/cuBLAS development files is installed,
# even for a CPU-only consumer. We still ask Python for torch.utils.cmake_prefix_path, as
# docs/architecture.md asks, and derive the include/lib folders from it. See docs/design.md.
#
# Inputs:  OAR_PYTHON_EXECUTABLE (or Python_EXECUTABLE) -- the interpreter whose torch to use;
#          OAR_TORCH_OPTIONAL -- when true, a missing torch is reported and OAR_TORCH_FOUND left FALSE
#          instead of stopping (used by the installed oarConfig.cmake so oar::core works without torch).
# Outputs: OAR_TORCH_FOUND, OAR_TORCH_VERSION (2.14.1), OAR_TORCH_VERSION_FULL (torch.__version__, e.g.
#          2.14.1+cu130), OAR_TORCH_HAS_CUDA, OAR_TORCH_LIB_DIR, OAR_TORCH_CUDA_VERSION, OAR_TORCH_CXX11_ABI (0/1).
include_guard(GLOBAL)

set(OAR_TORCH_FOUND FALSE)
if(NOT OAR_PYTHON_EXECUTABLE)
  if(Python_EXECUTABLE)
    set(OAR_PYTHON_EXECUTABLE "${Python_EXECUTABLE}")
  else()
    find_program(OAR_PYTHON_EXECUTABLE NAMES python3 python)
  endif()
endif()

execute_process(
  COMMAND "${OAR_PYTHON_EXECUTABLE}" -c
    "import torch, torch.utils, os; p = torch.utils.cmake_prefix_path; r = os.path.dirname(os.path.dirname(p)); print(';'.join([torch.__version__.split('+')[0], r, str(int(torch._C._GLIBCXX_USE_CXX11_ABI)), str(torch.version.cuda or ''), str(torch.__version__)]))"
  OUTPUT_VARIABLE _oar_torch_info
  RESULT_VARIABLE _oar_torch_rc
  ERROR_VARIABLE _oar_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _oar_torch_rc EQUAL 0)
  set(_oar_msg "oar: could not import torch with '${OAR_PYTHON_EXECUTABLE}': ${_oar_torch_err}\n"
               "Install torch (a supported version, README 'Install'), activate the environment that has it, "
               "or pass -DOAR_PYTHON_EXECUTABLE=/path/to/python")
  if(OAR_TORCH_OPTIONAL)
    message(STATUS "${_oar_msg}\noar: oar::torch is not available; oar::core is.")
    return()
  endif()
  message(FATAL_ERROR "${_oar_msg}")
endif()
list(GET _oar_torch_info 0 OAR_TORCH_VERSION)
list(GET _oar_torch_info 1 _oar_torch_root)
list(GET _oar_torch_info 2 _oar_torch_abi)
list(GET _oar_torch_info 3 OAR_TORCH_CUDA_VERSION)
list(GET _oar_torch_info 4 OAR_TORCH_VERSION_FULL)
set(OAR_TORCH_CXX11_ABI "${_oar_torch_abi}")
set(OAR_TORCH_LIB_DIR "${_oar_torch_root}/lib")
if(OAR_TORCH_CUDA_VERSION)
  set(OAR_TORCH_HAS_CUDA ON)
else()
  set(OAR_TORCH_HAS_CUDA OFF)
endif()

foreach(_lib c10 torch_cpu torch)
  find_library(OAR_TORCH_${_lib}_LIBRARY NAMES ${_lib} PATHS "${OAR_TORCH_LIB_DIR}" NO_DEFAULT_PATH REQUIRED)
endforeach()

if(NOT TARGET oar_torch::cpu)
  add_library(oar_torch::cpu INTERFACE IMPORTED)
  target_include_directories(oar_torch::cpu SYSTEM INTERFACE
    "${_oar_torch_root}/include" "${_oar_torch_root}/include/torch/csrc/api/include")
  target_compile_definitions(oar_torch::cpu INTERFACE _GLIBCXX_USE_CXX11_ABI=${_oar_torch_abi})
  target_link_libraries(oar_torch::cpu INTERFACE
    "${OAR_TORCH_torch_LIBRARY}" "${OAR_TORCH_torch_cpu_LIBRARY}" "${OAR_TORCH_c10_LIBRARY}")
endif()

if(OAR_TORCH_HAS_CUDA AND NOT TARGET oar_torch::cuda)
  find_library(OAR_TORCH_torch_cuda_LIBRARY NAMES torch_cuda PATHS "${OAR_TORCH_LIB_DIR}" NO_DEFAULT_PATH)
  find_library(OAR_TORCH_c10_cuda_LIBRARY NAMES c10_cuda PATHS "${OAR_TORCH_LIB_DIR}" NO_DEFAULT_PATH)
  if(OAR_TORCH_torch_cuda_LIBRARY AND OAR_TORCH_c10_cuda_LIBRARY)
    add_library(oar_torch::cuda INTERFACE IMPORTED)
    target_link_libraries(oar_torch::cuda INTERFACE
      oar_torch::cpu "${OAR_TORCH_torch_cuda_LIBRARY}" "${OAR_TORCH_c10_cuda_LIBRARY}")
  else()
    set(OAR_TORCH_HAS_CUDA OFF)
  endif()
endif()
set(OAR_TORCH_FOUND TRUE)
message(STATUS "oar: torch ${OAR_TORCH_VERSION} at ${_oar_torch_root} (CUDA: ${OAR_TORCH_CUDA_VERSION}, cxx11 abi ${_oar_torch_abi})")
