# Read by cpack for each generator (CPACK_PROJECT_CONFIG_FILE): stops a Debian package whose library
# folder NCCL would not search (see PontePackage.cmake).
if(CPACK_GENERATOR STREQUAL "DEB" AND CPACK_PONTE_LIBDIR_PROBLEM)
  message(FATAL_ERROR "ponte: ${CPACK_PONTE_LIBDIR_PROBLEM}")
endif()
