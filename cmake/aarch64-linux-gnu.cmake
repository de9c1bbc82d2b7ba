# Cross build for 64-bit ARM Linux (scripts/arm64-kernels.sh): Debian's cross compiler with its
# target C and C++ libraries (/usr/aarch64-linux-gnu), and a sysroot of Debian's arm64 packages of
# Abseil and GoogleTest that scripts/setup.sh unpacks (SHARDSERVE_ARM64_SYSROOT).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
if(NOT SHARDSERVE_ARM64_SYSROOT)
  set(SHARDSERVE_ARM64_SYSROOT "$ENV{SHARDSERVE_ARM64_SYSROOT}")
endif()
if(NOT IS_DIRECTORY "${SHARDSERVE_ARM64_SYSROOT}/usr/include/absl")
  message(FATAL_ERROR "SHARDSERVE_ARM64_SYSROOT ('${SHARDSERVE_ARM64_SYSROOT}') holds no arm64 "
                      "Abseil: scripts/setup.sh tests unpacks it")
endif()
set(CMAKE_FIND_ROOT_PATH "${SHARDSERVE_ARM64_SYSROOT}" /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Abseil's shared libraries name each other: the linker finds them in the sysroot.
set(CMAKE_EXE_LINKER_FLAGS_INIT
    "-Wl,-rpath-link,${SHARDSERVE_ARM64_SYSROOT}/usr/lib/aarch64-linux-gnu")
