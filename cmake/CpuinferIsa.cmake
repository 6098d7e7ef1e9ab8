# The ISA table and the choice of variants to build.
#
# Reads cmake/isa_table.json (variant -> compile flags, vector layer, required
# CPU features), works out the target platform, probes the build host's CPU
# with csrc/probe/cpu_probe.c (the same probe the runtime dispatcher uses), and
# sets:
#   CPUINFER_PLATFORM   key of the table ("x86_64", "aarch64", "arm64-apple", "s390x")
#   CPUINFER_VARIANTS   the variants to compile, generic first
# plus, per variant V: CPUINFER_FLAGS_<V>, CPUINFER_VEC_<V>, CPUINFER_HEADERS_<V> (its vector layer's
# header and hook headers, as compile definitions).
#
# Inputs (environment, or -D cache variables of the same name):
#   CPUINFER_ISAS       "native" (default: what this host runs, plus generic),
#                       "all" (release wheels), or a comma list of names
#   VLLM_CPU_AVX512BF16 / CPUINFER_CPU_AVX512BF16   1 forces avx512bf16 in (vLLM's switch)

set(CPUINFER_ISA_TABLE "${CMAKE_CURRENT_LIST_DIR}/isa_table.json")
file(READ "${CPUINFER_ISA_TABLE}" _table)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${CPUINFER_ISA_TABLE}")

# --- target platform ------------------------------------------------------
string(TOLOWER "${CMAKE_SYSTEM_PROCESSOR}" _proc)
if(_proc MATCHES "^(x86_64|amd64)$")
  set(CPUINFER_PLATFORM "x86_64")
elseif(_proc MATCHES "^(aarch64|arm64)$" AND APPLE)
  set(CPUINFER_PLATFORM "arm64-apple")
elseif(_proc MATCHES "^(aarch64|arm64)$")
  set(CPUINFER_PLATFORM "aarch64")
elseif(_proc STREQUAL "s390x")
  set(CPUINFER_PLATFORM "s390x")
else()
  message(FATAL_ERROR "cpuinfer: no ISA table entry for processor '${CMAKE_SYSTEM_PROCESSOR}'. "
                      "Supported: x86_64, aarch64 (Linux, macOS) and s390x.")
endif()

# CPUINFER_TARGET_PLATFORM=arm64-apple on an aarch64 Linux toolchain builds
# the Apple variants' kernels there (compile check and qemu run; see
# cmake/toolchains/apple-check-clang.cmake). Python extensions stay real-target only.
if(CPUINFER_TARGET_PLATFORM)
  if(NOT (CPUINFER_TARGET_PLATFORM STREQUAL "arm64-apple" AND CPUINFER_PLATFORM STREQUAL "aarch64"))
    message(FATAL_ERROR "cpuinfer: CPUINFER_TARGET_PLATFORM='${CPUINFER_TARGET_PLATFORM}' is only supported as "
                        "'arm64-apple' with an aarch64 toolchain (target here: ${CPUINFER_PLATFORM}).")
  endif()
  set(CPUINFER_PLATFORM "${CPUINFER_TARGET_PLATFORM}")
endif()

string(JSON _platform GET "${_table}" platforms "${CPUINFER_PLATFORM}")
string(JSON _count LENGTH "${_platform}")
math(EXPR _last "${_count} - 1")
set(CPUINFER_TABLE_VARIANTS "")
foreach(i RANGE ${_last})
  string(JSON _name MEMBER "${_platform}" ${i})
  list(APPEND CPUINFER_TABLE_VARIANTS "${_name}")
  string(JSON _entry GET "${_platform}" "${_name}")
  string(JSON _vec GET "${_entry}" vec)
  # The vector layer's header and its ISA fast-path headers (hooks), as
  # compile definitions CPUINFER_VEC_HEADER, CPUINFER_<HOOK>_HOOKS.
  string(JSON _layer ERROR_VARIABLE _missing GET "${_table}" vec_layers "${_vec}")
  if(_missing)
    message(FATAL_ERROR "cpuinfer: variant ${_name} names vector layer '${_vec}', which isa_table.json's "
                        "vec_layers does not list")
  endif()
  string(JSON _header GET "${_layer}" header)
  set(CPUINFER_HEADERS_${_name} "CPUINFER_VEC_HEADER=\"${_header}\"")
  foreach(_hook panel quant attention)
    string(JSON _h ERROR_VARIABLE _none GET "${_layer}" ${_hook})
    if(NOT _none)
      string(TOUPPER "${_hook}" _uhook)
      list(APPEND CPUINFER_HEADERS_${_name} "CPUINFER_${_uhook}_HOOKS=\"${_h}\"")
    endif()
  endforeach()
  string(TOUPPER "${_vec}" _vec)
  set(CPUINFER_VEC_${_name} "${_vec}")
  foreach(_key flags features)
    set(_list "")
    string(JSON _n LENGTH "${_entry}" ${_key})
    if(_n GREATER 0)
      math(EXPR _nl "${_n} - 1")
      foreach(j RANGE ${_nl})
        string(JSON _item GET "${_entry}" ${_key} ${j})
        list(APPEND _list "${_item}")
      endforeach()
    endif()
    string(TOUPPER "${_key}" _ukey)
    set(CPUINFER_${_ukey}_${_name} "${_list}")
  endforeach()
  # CPUINFER_FLAGS_OVERRIDE_<variant>: replacement flags for a compiler that
  # lacks the table's (e.g. -mcpu=apple-m2 before clang 15); checks only.
  if(DEFINED CPUINFER_FLAGS_OVERRIDE_${_name})
    message(STATUS "cpuinfer: ${_name} flags overridden: ${CPUINFER_FLAGS_OVERRIDE_${_name}} "
                   "(table: ${CPUINFER_FLAGS_${_name}})")
    set(CPUINFER_FLAGS_${_name} "${CPUINFER_FLAGS_OVERRIDE_${_name}}")
  endif()
endforeach()

# --- inputs ---------------------------------------------------------------
function(_cpuinfer_input name out)
  if(DEFINED ${name})
    set(${out} "${${name}}" PARENT_SCOPE)
  elseif(DEFINED ENV{${name}})
    set(${out} "$ENV{${name}}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# vLLM's boolean switches accept 0/1/true/false (any case); anything else is
# an error rather than a silent default.
function(_cpuinfer_bool name value out)
  string(TOLOWER "${value}" v)
  if(v STREQUAL "")
    set(${out} OFF PARENT_SCOPE)
  elseif(v MATCHES "^(1|true|yes|on)$")
    set(${out} ON PARENT_SCOPE)
  elseif(v MATCHES "^(0|false|no|off)$")
    set(${out} OFF PARENT_SCOPE)
  else()
    message(FATAL_ERROR "cpuinfer: ${name}='${value}' is not a boolean; use 1 or 0 (true/false).")
  endif()
endfunction()

_cpuinfer_input(CPUINFER_ISAS _isas)
string(STRIP "${_isas}" _isas)
string(TOLOWER "${_isas}" _isas)
if(_isas STREQUAL "")
  set(_isas "native")
endif()

# --- host detection -------------------------------------------------------
function(cpuinfer_probe_host out_features)
  try_run(_run _compiled
    SOURCES "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../csrc/probe/cpu_probe.c"
    COMPILE_DEFINITIONS -DCPUINFER_PROBE_MAIN
    COMPILE_OUTPUT_VARIABLE _cout
    RUN_OUTPUT_VARIABLE _out)
  if(NOT _compiled OR NOT _run EQUAL 0)
    message(FATAL_ERROR "cpuinfer: could not build or run the CPU probe on the build host:\n${_cout}")
  endif()
  string(STRIP "${_out}" _out)
  list(POP_FRONT _out _arch)
  set(${out_features} "${_out}" PARENT_SCOPE)
endfunction()

set(CPUINFER_VARIANTS "generic")
if(_isas STREQUAL "all")
  set(CPUINFER_VARIANTS ${CPUINFER_TABLE_VARIANTS})
elseif(_isas STREQUAL "native")
  if(CMAKE_CROSSCOMPILING AND NOT CMAKE_CROSSCOMPILING_EMULATOR)
    message(STATUS "cpuinfer: cross-compiling without an emulator; building every variant")
    set(CPUINFER_VARIANTS ${CPUINFER_TABLE_VARIANTS})
  else()
    cpuinfer_probe_host(CPUINFER_HOST_FEATURES)
    message(STATUS "cpuinfer: build host features: ${CPUINFER_HOST_FEATURES}")
    foreach(v IN LISTS CPUINFER_TABLE_VARIANTS)
      set(_ok ON)
      foreach(f IN LISTS CPUINFER_FEATURES_${v})
        # OS grants checked at run time (AMX permission) are not build concerns.
        if(NOT f IN_LIST CPUINFER_HOST_FEATURES)
          set(_ok OFF)
        endif()
      endforeach()
      if(_ok)
        list(APPEND CPUINFER_VARIANTS "${v}")
      endif()
    endforeach()
  endif()
else()
  string(REPLACE "," ";" _requested "${_isas}")
  foreach(v IN LISTS _requested)
    string(STRIP "${v}" v)
    if(v STREQUAL "")
      continue()
    endif()
    if(NOT v IN_LIST CPUINFER_TABLE_VARIANTS)
      string(REPLACE ";" ", " _valid "${CPUINFER_TABLE_VARIANTS}")
      message(FATAL_ERROR "cpuinfer: CPUINFER_ISAS names unknown variant '${v}' for ${CPUINFER_PLATFORM}. "
                          "Valid: ${_valid}, or 'all' / 'native'.")
    endif()
    list(APPEND CPUINFER_VARIANTS "${v}")
  endforeach()
endif()

_cpuinfer_input(VLLM_CPU_AVX512BF16 _bf16_vllm)
_cpuinfer_input(CPUINFER_CPU_AVX512BF16 _bf16_own)
_cpuinfer_bool(VLLM_CPU_AVX512BF16 "${_bf16_vllm}" _force_a)
_cpuinfer_bool(CPUINFER_CPU_AVX512BF16 "${_bf16_own}" _force_b)
if(_force_a OR _force_b)
  if(NOT CPUINFER_PLATFORM STREQUAL "x86_64")
    message(FATAL_ERROR "cpuinfer: VLLM_CPU_AVX512BF16=1 asks for an x86 variant, but the target is ${CPUINFER_PLATFORM}.")
  endif()
  list(APPEND CPUINFER_VARIANTS "avx512bf16")
endif()
list(REMOVE_DUPLICATES CPUINFER_VARIANTS)
string(REPLACE ";" ", " _chosen "${CPUINFER_VARIANTS}")
message(STATUS "cpuinfer: platform ${CPUINFER_PLATFORM}, variants: ${_chosen}")
