# Writes ponte_version.h (run at build time: cmake -DSOURCE_DIR=.. -DOUTPUT=.. -DVERSION=..
# [-DGIT_COMMIT=..] -P ponte_version.cmake). The version comes from project(VERSION) in the top
# CMakeLists.txt; the git commit from the checkout, when the sources are one (a release tarball has
# no .git: the commit is then empty unless PONTE_GIT_COMMIT was given). The file is rewritten only
# when its text changes, so a build at the same commit recompiles nothing.
if(NOT GIT_COMMIT)
  find_program(_git git)
  if(_git)
    # Only this tree's own repository: a tarball unpacked inside another checkout has none.
    execute_process(COMMAND ${_git} -C ${SOURCE_DIR} rev-parse --show-toplevel
                    OUTPUT_VARIABLE _top OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE _rc ERROR_QUIET)
    if(_rc EQUAL 0)
      file(REAL_PATH "${_top}" _top)
      file(REAL_PATH "${SOURCE_DIR}" _src)
    endif()
    if(_rc EQUAL 0 AND _top STREQUAL _src)
      execute_process(COMMAND ${_git} -C ${SOURCE_DIR} rev-parse --short=12 HEAD
                      OUTPUT_VARIABLE GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      execute_process(COMMAND ${_git} -C ${SOURCE_DIR} status --porcelain --untracked-files=no
                      OUTPUT_VARIABLE _dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(GIT_COMMIT AND _dirty)
        string(APPEND GIT_COMMIT "-dirty")
      endif()
    endif()
  endif()
endif()
if(GIT_COMMIT)
  set(_string "${VERSION} (git ${GIT_COMMIT})")
else()
  set(GIT_COMMIT "")
  set(_string "${VERSION}")
endif()
set(_text "// ponte's version and the git commit it was built from (empty outside a checkout).
// Generated at build time by cmake/ponte_version.cmake; do not edit.
#pragma once
#define PONTE_VERSION \"${VERSION}\"
#define PONTE_GIT_COMMIT \"${GIT_COMMIT}\"
#define PONTE_VERSION_STRING \"${_string}\"
")
set(_old "")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} _old)
endif()
if(NOT _old STREQUAL _text)
  file(WRITE ${OUTPUT} "${_text}")
endif()
