# Helpers shared by every module: warnings, sanitizers, tests, configure summary.

function(nonstop_summary text ok)
  if(ok)
    message(STATUS "  ✓ ${text}")
  else()
    message(STATUS "  → ${text}")
  endif()
endfunction()

# Warnings and sanitizers are set per target, never through CMAKE_CXX_FLAGS.
function(nonstop_target_options target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
  if(NONSTOP_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  # Clang checks the locking annotations (src/common/mutex.h), and a violation
  # is an error even without NONSTOP_WERROR: the clang trees (scripts/build.sh
  # --sanitize, --fuzz) do not build code that touches guarded data unlocked.
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    target_compile_options(${target} PRIVATE -Wthread-safety -Werror=thread-safety)
  endif()
  # UBSan reports are fatal (-fno-sanitize-recover=all): a report fails the test that caused it.
  if(NONSTOP_ENABLE_ASAN)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all
                                             -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all)
  endif()
  if(NONSTOP_ENABLE_TSAN)
    target_compile_options(${target} PRIVATE -fsanitize=thread -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=thread)
  endif()
  # The fuzzing build (fuzz/): every library carries libFuzzer's coverage
  # instrumentation plus ASan and fatal UBSan; fuzz/ links the targets with
  # -fsanitize=fuzzer, which brings libFuzzer's main.
  if(NONSTOP_BUILD_FUZZERS)
    target_compile_options(${target} PRIVATE -fsanitize=fuzzer-no-link,address,undefined
                                             -fno-sanitize-recover=all -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all)
  endif()
endfunction()

# Refuses sanitizer combinations that cannot work, before anything is built.
function(nonstop_check_sanitizers)
  if(NONSTOP_ENABLE_ASAN AND NONSTOP_ENABLE_TSAN)
    message(FATAL_ERROR "NONSTOP_ENABLE_ASAN and NONSTOP_ENABLE_TSAN cannot be combined: "
                        "build them in separate trees (scripts/build.sh --sanitize address|thread)")
  endif()
  if(NONSTOP_BUILD_FUZZERS AND NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "NONSTOP_BUILD_FUZZERS needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "configure with -DCMAKE_CXX_COMPILER=clang++-16 (scripts/build.sh --fuzz does)")
  endif()
  if(NONSTOP_BUILD_FUZZERS AND (NONSTOP_ENABLE_ASAN OR NONSTOP_ENABLE_TSAN))
    message(FATAL_ERROR "NONSTOP_BUILD_FUZZERS already builds with ASan and UBSan: "
                        "leave NONSTOP_ENABLE_ASAN and NONSTOP_ENABLE_TSAN off in the fuzzing tree")
  endif()
  if(NONSTOP_ENABLE_ASAN)
    nonstop_summary("AddressSanitizer + UBSan (fatal)" TRUE)
  endif()
  if(NONSTOP_ENABLE_TSAN)
    nonstop_summary("ThreadSanitizer" TRUE)
  endif()
  if(NONSTOP_BUILD_FUZZERS)
    nonstop_summary("libFuzzer targets (fuzz/), with ASan + UBSan" TRUE)
  endif()
endfunction()

# nonstop_add_library(name SOURCES ... DEPS ... [PRIVATE_DEPS ...])
function(nonstop_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  nonstop_target_options(${name})
endfunction()

# nonstop_add_test(name SOURCES ... LIBS ... [LABELS ...] [TIMEOUT seconds])
# Every test gets a CTest timeout: distributed bugs hang instead of failing.
function(nonstop_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 60)
  endif()
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
  nonstop_target_options(${name})
  if(NONSTOP_TEST_LABELS)
    set(wanted FALSE)
    foreach(label ${ARG_LABELS})
      if(label IN_LIST NONSTOP_TEST_LABELS)
        set(wanted TRUE)
      endif()
    endforeach()
    if(NOT wanted)
      # A tree that runs only some labels (the ASan one) does not build the rest.
      set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL TRUE)
      return()
    endif()
  endif()
  gtest_discover_tests(${name}
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 30)
endfunction()

# nonstop_add_fuzzer(name SOURCES ... LIBS ...): the target fuzz_<name>, whose
# seed corpus is fuzz/corpus/<name>/. With NONSTOP_BUILD_FUZZERS it is a
# libFuzzer binary (scripts/fuzz.sh runs it); otherwise it replays files
# through the same entry point (fuzz/replay_main.cc) and the CTest
# fuzz_<name>_corpus replays the corpus, so every input that once crashed
# stays a regression test in every build, sanitizers included.
function(nonstop_add_fuzzer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  set(target fuzz_${name})
  if(NONSTOP_BUILD_FUZZERS)
    add_executable(${target} ${ARG_SOURCES})
    target_link_options(${target} PRIVATE -fsanitize=fuzzer)
  else()
    add_executable(${target} ${ARG_SOURCES} ${PROJECT_SOURCE_DIR}/fuzz/replay_main.cc)
  endif()
  target_link_libraries(${target} PRIVATE ${ARG_LIBS})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/src)
  nonstop_target_options(${target})
  if(NONSTOP_BUILD_TESTS AND NOT NONSTOP_BUILD_FUZZERS)
    add_test(NAME fuzz_${name}_corpus COMMAND ${target} ${PROJECT_SOURCE_DIR}/fuzz/corpus/${name})
    set_tests_properties(fuzz_${name}_corpus PROPERTIES LABELS unit TIMEOUT 60)
  endif()
endfunction()
