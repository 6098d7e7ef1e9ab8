# Build plumbing: parallel job limit (MAX_JOBS), ccache, the ABI stamp, and
# cpuinfer_add_kernels(<variant>), which compiles the kernel core once with
# that variant's flags.

# MAX_JOBS caps parallel compile jobs, as in vLLM / PyTorch builds.
_cpuinfer_input(MAX_JOBS _max_jobs)
if(NOT _max_jobs STREQUAL "")
  if(NOT _max_jobs MATCHES "^[1-9][0-9]*$")
    message(FATAL_ERROR "cpuinfer: MAX_JOBS='${_max_jobs}' is not a positive integer.")
  endif()
  set_property(GLOBAL APPEND PROPERTY JOB_POOLS cpuinfer_compile=${_max_jobs})
  set(CMAKE_JOB_POOL_COMPILE cpuinfer_compile)
  message(STATUS "cpuinfer: at most ${_max_jobs} parallel compile jobs (MAX_JOBS)")
endif()

find_program(CPUINFER_CCACHE ccache)
if(CPUINFER_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_C_COMPILER_LAUNCHER "${CPUINFER_CCACHE}")
  set(CMAKE_CXX_COMPILER_LAUNCHER "${CPUINFER_CCACHE}")
  message(STATUS "cpuinfer: using ccache (${CPUINFER_CCACHE})")
endif()

# The ABI stamp: a hash of every kernel and binding source plus the ISA
# table, computed by the same Python code the dispatcher uses to check it.
set(CPUINFER_SRC_ROOT "${CMAKE_CURRENT_LIST_DIR}/..")
file(GLOB_RECURSE CPUINFER_STAMPED_SOURCES CONFIGURE_DEPENDS
     "${CPUINFER_SRC_ROOT}/csrc/*.h" "${CPUINFER_SRC_ROOT}/csrc/*.c" "${CPUINFER_SRC_ROOT}/csrc/*.cpp")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CPUINFER_STAMPED_SOURCES})
find_package(Python 3.10 COMPONENTS Interpreter REQUIRED)
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CPUINFER_SRC_ROOT}/src/cpuinfer/_abi.py" "${CPUINFER_SRC_ROOT}"
  OUTPUT_VARIABLE CPUINFER_ABI_STAMP OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _stamp_rc)
if(NOT _stamp_rc EQUAL 0)
  message(FATAL_ERROR "cpuinfer: computing the ABI stamp failed")
endif()
message(STATUS "cpuinfer: ABI stamp ${CPUINFER_ABI_STAMP}")

set(CPUINFER_KERNEL_SOURCES
  "${CPUINFER_SRC_ROOT}/csrc/common/norm.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/rotary.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/activation.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/argmax.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/linear.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/linear_packed.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/linear_quant.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/linear_peak.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/kv_cache.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/paged_attention.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/decoder_layer.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/moe.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/parallel.cpp"
  "${CPUINFER_SRC_ROOT}/csrc/common/shm_comm.cpp")

# Test-only: compile the AVX-512 vector layer against SIMDe (libsimde-dev)
# without the -march flags, so the C++ test program checks its logic on CPUs
# without AVX-512. Never for shipped extensions.
option(CPUINFER_SIMDE_EMULATION "Build avx512* variants on SIMDe's portable AVX-512 (tests only)" OFF)
if(CPUINFER_SIMDE_EMULATION)
  if(CPUINFER_BUILD_PYTHON)
    message(FATAL_ERROR "cpuinfer: CPUINFER_SIMDE_EMULATION is for the C++ test program only; "
                        "configure with -DCPUINFER_BUILD_PYTHON=OFF -DCPUINFER_BUILD_TESTS=ON.")
  endif()
  find_path(CPUINFER_SIMDE_INCLUDE simde/x86/avx512.h)
  if(NOT CPUINFER_SIMDE_INCLUDE)
    message(FATAL_ERROR "cpuinfer: CPUINFER_SIMDE_EMULATION needs SIMDe headers (apt install libsimde-dev).")
  endif()
endif()

# cpuinfer_add_kernels(<variant>): static library cpuinfer_kernels_<variant>.
function(cpuinfer_add_kernels variant)
  set(lib cpuinfer_kernels_${variant})
  add_library(${lib} STATIC ${CPUINFER_KERNEL_SOURCES})
  set_target_properties(${lib} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
                                          VISIBILITY_INLINES_HIDDEN ON)
  if(NOT CPUINFER_BUILD_PYTHON)
    # A C++-tests-only build compiles just the variants a test program links (CPUINFER_TEST_VARIANTS).
    set_target_properties(${lib} PROPERTIES EXCLUDE_FROM_ALL ON)
  endif()
  if(CPUINFER_SIMDE_EMULATION AND CPUINFER_VEC_${variant} STREQUAL "AVX512")
    target_compile_definitions(${lib} PUBLIC CPUINFER_SIMDE_EMULATION)
    target_include_directories(${lib} PUBLIC "${CPUINFER_SIMDE_INCLUDE}")
    if("-mavx512bf16" IN_LIST CPUINFER_FLAGS_${variant})
      target_compile_definitions(${lib} PUBLIC CPUINFER_SIMDE_AVX512BF16)
    endif()
    if("-mamx-bf16" IN_LIST CPUINFER_FLAGS_${variant})
      target_compile_definitions(${lib} PUBLIC CPUINFER_SIMDE_AMX)  # csrc/x86/emulation/amx_emulation.h
    endif()
  else()
    target_compile_options(${lib} PUBLIC ${CPUINFER_FLAGS_${variant}})
  endif()
  target_compile_definitions(${lib} PUBLIC CPUINFER_VEC_${CPUINFER_VEC_${variant}} ${CPUINFER_HEADERS_${variant}})
  if(CPUINFER_PLATFORM STREQUAL "arm64-apple")
    target_compile_definitions(${lib} PUBLIC CPUINFER_TUNING_HEADER="apple/apple_tuning.h")
  endif()
  target_include_directories(${lib} PUBLIC "${CPUINFER_SRC_ROOT}/csrc")
  if(CMAKE_DL_LIBS)
    target_link_libraries(${lib} PUBLIC ${CMAKE_DL_LIBS})
  endif()
  # shm_open lives in librt before glibc 2.34 (manylinux_2_28 builds against 2.28).
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    target_link_libraries(${lib} PUBLIC rt)
  endif()
endfunction()
