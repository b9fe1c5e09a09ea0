# The public API is the only way in (docs/architecture.md "Code style", issue 24): fails when the
# reference trainer (apps/train, the program users copy) includes a runtime
# header from src/ other than the LibTorch adapter (src/torch/), or when a
# public header (include/nonstop/) includes anything of the project's but
# another public header. Run by CTest as public_includes_test:
#
#   cmake -DROOT=<source dir> -P cmake/check_public_includes.cmake
#
# The files are listed by glob on purpose: a new trainer file is checked
# without anyone remembering to add it here.
if(NOT ROOT)
  message(FATAL_ERROR "check_public_includes.cmake: pass -DROOT=<source dir>")
endif()

set(internal_modules "agent|collective|common|control|controller|coord|dashboard|data|elastic|launcher|net|state|worker")
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
  check_file("${f}" MATCHING "include[ \t]*\"(${internal_modules})/" "an internal runtime header: use include/nonstop/")
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
message(STATUS "public includes: ${n_trainer} trainer files and ${n_public} public headers include no internal header")
