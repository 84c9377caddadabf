# How ponte installs (cmake --install, cpack) and what a consumer finds: ponte's version header,
# one function per kind of installed thing, and the CMake package / pkg-config files.
#
# The convention, for a folder that adds something people install:
#   a library for consumers   ponte_install_library(<static-target> NAME <name> OUTPUT_NAME <lib>
#                                 HEADERS <files...> [PUBLIC <targets...>] [PRIVATE <targets...>]
#                                 [PC_REQUIRES <pkg-config names...>] DESCRIPTION <text>)
#                             builds lib<lib>.so (SONAME lib<lib>.so.<PONTE_SOVERSION>) from the
#                             static target's objects (compiled once; tests and the plugin keep
#                             linking the static archive), exports it as ponte::<name>, installs
#                             the headers under include/ponte/<their folder>/ and lib<lib>.pc.
#                             PUBLIC: what a consumer also links (another ponte::<name>, never a
#                             static archive of ponte: the code would be in two libraries);
#                             PRIVATE: static archives and libraries linked in, not exported.
#   a program                 ponte_install_programs(<targets...>)          -> bin/
#   a Python extension        install(TARGETS <module> LIBRARY DESTINATION ${PONTE_INSTALL_PYTHONDIR})
# ponte_install_package() (last, from the top CMakeLists.txt) writes ponteConfig.cmake with every
# ponte::<name> of the export set, and the version file.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# 0.x: every minor version may change the ABI, so it is part of the SONAME (libponte.so.0.1).
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(PONTE_SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
else()
  set(PONTE_SOVERSION ${PROJECT_VERSION_MAJOR})
endif()
set(PONTE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/ponte)
set(PONTE_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/ponte)

# ponte_version.h (PONTE_VERSION, PONTE_GIT_COMMIT, PONTE_VERSION_STRING), regenerated at every
# build so that it follows the checkout's commit; targets that print the version link
# ponte_version_info. PONTE_GIT_COMMIT names the commit where the sources are not a checkout.
set(PONTE_GIT_COMMIT "" CACHE STRING "git commit to report when building outside a checkout")
set(_ponte_version_h ${PROJECT_BINARY_DIR}/generated/ponte_version.h)
add_custom_target(ponte_version_header
  COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DOUTPUT=${_ponte_version_h}
          -DVERSION=${PROJECT_VERSION} -DGIT_COMMIT=${PONTE_GIT_COMMIT}
          -P ${CMAKE_CURRENT_LIST_DIR}/ponte_version.cmake
  BYPRODUCTS ${_ponte_version_h}
  COMMENT "ponte version header"
  VERBATIM)
add_library(ponte_version_info INTERFACE)
target_include_directories(ponte_version_info INTERFACE ${PROJECT_BINARY_DIR}/generated)
add_dependencies(ponte_version_info ponte_version_header)

function(ponte_install_programs)
  install(TARGETS ${ARGN} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()

function(ponte_install_library static)
  cmake_parse_arguments(arg "" "NAME;OUTPUT_NAME;DESCRIPTION" "HEADERS;PUBLIC;PRIVATE;PC_REQUIRES"
                        ${ARGN})
  set(lib ponte_${arg_NAME}_shared)
  add_library(${lib} SHARED $<TARGET_OBJECTS:${static}>)
  add_library(ponte::${arg_NAME} ALIAS ${lib})
  set_target_properties(${lib} PROPERTIES
    OUTPUT_NAME ${arg_OUTPUT_NAME}
    EXPORT_NAME ${arg_NAME}
    VERSION ${PROJECT_VERSION}
    SOVERSION ${PONTE_SOVERSION})
  target_include_directories(${lib} INTERFACE
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:${PONTE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${lib} PUBLIC ${arg_PUBLIC} Threads::Threads PRIVATE ${arg_PRIVATE})
  # The static archives linked in keep their symbols inside; complete at link time (except under a
  # sanitizer, whose runtime the executable brings).
  target_link_options(${lib} PRIVATE -Wl,--exclude-libs,ALL)
  if(NOT PONTE_SANITIZE)
    target_link_options(${lib} PRIVATE -Wl,--no-undefined)
  endif()
  set_target_properties(${lib} PROPERTIES LINKER_LANGUAGE CXX)
  install(TARGETS ${lib} EXPORT ponteTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  foreach(h ${arg_HEADERS})
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/${h})
    get_filename_component(dir ${rel} DIRECTORY)
    install(FILES ${h} DESTINATION ${PONTE_INSTALL_INCLUDEDIR}/${dir})
  endforeach()
  # pkg-config: the same library, include folder and requirements as the CMake target.
  string(REPLACE ";" " " PC_REQUIRES "${arg_PC_REQUIRES}")
  set(PC_NAME ${arg_OUTPUT_NAME})
  set(PC_DESCRIPTION "${arg_DESCRIPTION}")
  set(PC_LIB ${arg_OUTPUT_NAME})
  # Relocatable: the prefix is found from the .pc file's own folder (cmake --install --prefix P).
  file(RELATIVE_PATH up /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
  string(REGEX REPLACE "/$" "" up "${up}")
  set(PC_PREFIX "\${pcfiledir}/${up}")
  foreach(kind LIBDIR INCLUDEDIR)
    if(IS_ABSOLUTE ${CMAKE_INSTALL_${kind}})
      set(PC_${kind} ${CMAKE_INSTALL_${kind}})
    else()
      set(PC_${kind} "\${prefix}/${CMAKE_INSTALL_${kind}}")
    endif()
  endforeach()
  configure_file(${PROJECT_SOURCE_DIR}/cmake/ponte.pc.in
                 ${PROJECT_BINARY_DIR}/pkgconfig/${arg_OUTPUT_NAME}.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${arg_OUTPUT_NAME}.pc
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endfunction()

function(ponte_install_package)
  install(EXPORT ponteTargets NAMESPACE ponte:: DESTINATION ${PONTE_INSTALL_CMAKEDIR})
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ponteConfig.cmake.in
    ${PROJECT_BINARY_DIR}/ponteConfig.cmake INSTALL_DESTINATION ${PONTE_INSTALL_CMAKEDIR})
  # 0.x: only the same minor version is compatible (as the SONAME says).
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(compat SameMinorVersion)
  else()
    set(compat SameMajorVersion)
  endif()
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/ponteConfigVersion.cmake
    COMPATIBILITY ${compat})
  install(FILES ${PROJECT_BINARY_DIR}/ponteConfig.cmake ${PROJECT_BINARY_DIR}/ponteConfigVersion.cmake
          DESTINATION ${PONTE_INSTALL_CMAKEDIR})
endfunction()
