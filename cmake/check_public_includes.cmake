# The public API is the only way in (docs/architecture.md "Code style", issues 24 and 53): an
# allow-list of what each side may include in quotes. The reference trainer (apps/train, the
# program users copy) includes only public headers (nonstop/), the LibTorch adapter (torch/, in
# src/torch) and its own (apps/train/); the Python package's module (src/python) only public
# headers; a public header (include/nonstop/) only other public headers. Anything else, a runtime
# header of src/ or one of apps/nonstop, fails. Run by CTest as public_includes_test:
#
#   cmake -DROOT=<source dir> -P cmake/check_public_includes.cmake
#
# The files are listed by glob on purpose: a new trainer file is checked
# without anyone remembering to add it here.
if(NOT ROOT)
  message(FATAL_ERROR "check_public_includes.cmake: pass -DROOT=<source dir>")
endif()

set(violations "")

# Appends "file: line (why)" to `violations` for every quoted #include in
# `file` that matches `regex` (MATCHING) or does not (NOT_MATCHING).
function(check_file file mode regex why)
  file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS lines)
    set(hit FALSE)
    if(line MATCHES "${regex}")
      set(hit TRUE)
    endif()
    if(mode STREQUAL "NOT_MATCHING")
      if(hit)
        set(hit FALSE)
      else()
        set(hit TRUE)
      endif()
    endif()
    if(hit)
      file(RELATIVE_PATH rel "${ROOT}" "${file}")
      string(STRIP "${line}" line)
      string(APPEND violations "\n  ${rel}: ${line}  (${why})")
    endif()
  endforeach()
  set(violations "${violations}" PARENT_SCOPE)
endfunction()

file(GLOB trainer_files "${ROOT}/apps/train/*.cc" "${ROOT}/apps/train/*.h" "${ROOT}/apps/train/*.h.in")
if(NOT trainer_files)
  message(FATAL_ERROR "check_public_includes.cmake: no trainer sources under ${ROOT}/apps/train")
endif()
foreach(f IN LISTS trainer_files)
  check_file("${f}" NOT_MATCHING "include[ \t]*\"(nonstop|torch|apps/train)/"
             "the trainer includes only nonstop/, torch/ and apps/train/ headers")
endforeach()

file(GLOB python_files "${ROOT}/src/python/*.cc" "${ROOT}/src/python/*.h")
if(NOT python_files)
  message(FATAL_ERROR "check_public_includes.cmake: no Python module sources under ${ROOT}/src/python")
endif()
foreach(f IN LISTS python_files)
  check_file("${f}" NOT_MATCHING "include[ \t]*\"nonstop/" "the Python module includes only public headers")
endforeach()

file(GLOB public_headers "${ROOT}/include/nonstop/*.h")
foreach(f IN LISTS public_headers)
  check_file("${f}" NOT_MATCHING "include[ \t]*\"nonstop/" "a public header includes only public headers")
endforeach()

if(violations)
  message(FATAL_ERROR "internal headers reached from the public side:${violations}")
endif()
list(LENGTH trainer_files n_trainer)
list(LENGTH public_headers n_public)
list(LENGTH python_files n_python)
message(STATUS "public includes: ${n_trainer} trainer files, ${n_python} Python module files and "
               "${n_public} public headers include only what they may")
