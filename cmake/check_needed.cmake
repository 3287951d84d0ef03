# Run after linking libcircle_loss_ops (cmake -DLIBRARY=... -DREADELF=... -P):
# fails the build unless the library needs a shared libstdc++ and no libpython.
execute_process(
  COMMAND "${READELF}" -d "${LIBRARY}"
  OUTPUT_VARIABLE dynamic RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "circle_loss: ${READELF} -d ${LIBRARY} failed")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[[^]]*\\]" needed "${dynamic}")
if(NOT needed MATCHES "libstdc\\+\\+\\.so")
  message(FATAL_ERROR
    "circle_loss: ${LIBRARY} does not need a shared libstdc++ (NEEDED: ${needed}): a static "
    "C++ runtime was linked in, and errors raised inside the library would crash the process. "
    "Build with a compiler that links the shared libstdc++, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc.")
endif()
if(needed MATCHES "libpython|libtorch_python")
  message(FATAL_ERROR "circle_loss: ${LIBRARY} must not need libpython or libtorch_python (NEEDED: ${needed})")
endif()
